// Emulation shim (see ../build.py): CUDA built-ins come from the fiber emulator.
#pragma once
#include "cuda_runtime_api.h"
#include "emu_runtime.h"
