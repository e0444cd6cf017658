"""The tests' trainer and command-line processes forked from a process that has already imported what they import, so
each skips the ~4 s of CPU that importing torch, DTensor, DCP, transformers and datasets costs (a 1-step run of the
trainer: ~6.5 s of CPU as a fresh interpreter, ~1.5 s as a fork).

The tests' fork server (tests/forked.py) imports this module, and with it the package's modules, once per pytest
worker; each process is then a fork of it that takes the run's environment, working folder, argv and output files
and runs ``python -m MODULE`` / ``python SCRIPT`` as Python runs them. Only the server imports this module; it
imports no test code.

What a fork cannot give, the tests that need it launch a fresh interpreter (tests/helpers.py decides): a process
whose environment differs from the server's in what is read at start-up or import (PYTHONPATH's code loaded at
interpreter start, TRITON_INTERPRET, ...), every process after a forked one has crashed (tests/helpers.run_ranks
says why), and the tests of `python -m` or torchrun itself (the docs, cluster, signal, Slurm and install tests)."""

from __future__ import annotations

import gc
import importlib
import os
import sys

# One thread in the server, so that a fork copies a process whose every thread it has (POSIX: the fork of a process
# with more threads may call only async-signal-safe functions): pyarrow (datasets imports it) loads a jemalloc that
# starts a background thread as the library loads, unless its configuration says otherwise.
os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"

# What the trainer, the evaluation, generation and the exports import before their work starts (the tokenizer's,
# the dataset's and lm-eval's libraries are imported inside the functions that use them), less what writes to stderr
# as it is imported (FLA's CPU notice; transformers' model classes, through torchao): a fork must print what a fresh
# interpreter prints, for the tests of one-line errors ...
import datasets  # noqa: E402, F401
import lm_eval.evaluator  # noqa: E402, F401
import lm_eval.tasks  # noqa: E402, F401
import scipy.io  # noqa: E402, F401  (datasets imports it to patch it when it streams a dataset)
import torch._dynamo  # noqa: E402, F401  (FSDP2's DTensors import it on their first use)
import transformers  # noqa: E402, F401
from transformers.models.auto import tokenization_auto  # noqa: E402, F401

import hybridtitan  # noqa: E402

COMMANDS = ("train", "eval", "generate", "export_hf", "import_hf")
for _name in COMMANDS:
    importlib.import_module(f"hybridtitan.{_name}")
# ... but not the commands' own modules: `python -m` runs one as __main__ and holds no hybridtitan.train (runpy
# warns of a module run while it is already imported); no module of the package imports them at its top
for _name in COMMANDS:
    del sys.modules[f"hybridtitan.{_name}"]
    delattr(hybridtitan, _name)
# the objects made so far are never collected: a fork's garbage collections do not visit (and so copy) their pages
gc.collect()
gc.freeze()
