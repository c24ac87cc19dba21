"""The shared parts of the experiments: what the task modules build from.

==========================  =======================================================================
:mod:`.seeding`             ``member_generators``: every random stream of a run
:mod:`.layers`              the ensemble layers (linear, embedding, CNN, the gated-cell base)
:mod:`.arithmetic_models`   the arithmetic tasks' models and the unit table (``ARITHMETIC_UNITS``)
:mod:`.sequence_models`     the sequence tasks' recurrent layers (LSTM, GRU, UGRNN, recurrent NAC/NALU)
:mod:`.optim`               Adam for ensembles
:mod:`.training`            the training loops, the best-state keeper, evaluation
:mod:`.arithmetic_data`     the arithmetic tasks' data: operations, ranges, typed parameters, thresholds
:mod:`.uniform_stream`      the arithmetic tasks' training stream (per-seed uniform batches, subset sums)
:mod:`.mnist_data`          the digit images (MNIST, or a synthetic stand-in)
:mod:`.digit_sequences`     the digits task's model (CNN, code, recurrent layer) and sequence targets
:mod:`.number_words`        the language task's data: number words, tokens, the paper's split
==========================  =======================================================================
"""
