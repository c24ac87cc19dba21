"""The tasks: one module per experiment (its data, its model choice, its report), each registered by
:data:`nalu_cuda.experiments.EXPERIMENT_MODULES`. A task imports the shared parts and the core, never
another task (the static task's report and defaults, :mod:`.static_report` and :mod:`.static_defaults`,
are shared with the recurrent one)."""
