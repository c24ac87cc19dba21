// Emulation shim (see ../build.py): the CUDA runtime types the interface header needs.
#pragma once
typedef struct CUstream_st* cudaStream_t;
