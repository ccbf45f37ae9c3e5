"""asyncexec's kernels: every `torch.ops.asyncexec` op, and the C++ sources behind them.

- `packed_linear`: `asyncexec::packed_linear` and `asyncexec::packed_linear_group`, the op every linear
  runs once the load-time transform (`asyncexec.quantization`) has packed its weight; dense (oneDNN),
  int8 and int4 kernels, chosen by the step's rows; and the inductor pass that merges a group's calls.
- `paged_decode`: `asyncexec::paged_decode`, decode attention over the paged KV cache
  (`csrc/paged_decode.cpp`), and its inductor-compiled fallback.
- `paged_attention`: `asyncexec::paged_attention_rows`, every row's attention of a compiled mixed step
  (its schema and fake kernel; the worker registers its CPU kernel, which reads the step's metadata).
- `int8_gemv`: asyncexec's int8 GEMV for 1-4 rows (`csrc/int8_gemv.cpp`), called by `packed_linear`.
- `build`: the one build-and-load routine for the C++ sources, and the compile cache folder.

The runner decides when to run them; these modules decide how. They import only torch and each other.
Nothing is imported here: a module is loaded when it is first used.
"""
