"""Development tooling for the engines, not the product: benchmarks and tiny random models
for tests and the demo.

    bench.py      `tokenmill bench`: the reference engine against transformers (and vLLM)
    tiny.py       tiny random HF checkpoints with a locally trained tokenizer
    tiny_copy.py  a tiny Llama trained to copy its prompt (speculative-decoding benchmarks)

Product code does not import this package (an import-linter contract): fault injection for
tests is engines/faults.py, the calibration text is engines/quantize/calibration.py. The CLI's
development commands (`tokenmill bench`, `make-tiny-model`, `demo` in
pipeline/batch/driver/demo.py, `serve --make-demo-model`) import it, lazily.
"""
