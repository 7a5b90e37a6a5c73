"""Development tooling for the engines, not the product: benchmarks, tiny random models for
tests and the demo, and test hooks.

    bench.py      `tokenmill bench`: the reference engine against transformers (and vLLM)
    tiny.py       tiny random HF checkpoints with a locally trained tokenizer; built-in text
    tiny_copy.py  a tiny Llama trained to copy its prompt (speculative-decoding benchmarks)
    testhooks.py  fault and timing hooks for tests, inert without TOKENMILL_TEST_HOOKS=1

Product code may import only `testhooks` from here: its hooks do nothing unless the process
runs with TOKENMILL_TEST_HOOKS=1. Exceptions today, each a lazy import inside the function
that needs it: the CLI's development commands (`tokenmill bench`, `make-tiny-model`, `demo`
in pipeline/batch/driver/demo.py, `serve --make-demo-model`) and quantization's built-in calibration
text (engines/quantize/calibration.py, `tiny.sample_text`).
"""
