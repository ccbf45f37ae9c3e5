"""Graph mode on CPU: uniform decode batches run through decoder layers compiled by inductor.

What is compiled: each decoder layer's forward (regional compilation, as torch recommends for stacks of
identical blocks). All layers share one compiled graph, because nothing per layer is a constant to the
compiler: parameters are graph inputs, each layer's KV cache is its attention module's buffer
(`k_cache`, `v_cache`), and the paged attention is the custom op of `paged_decode.py`, which reads K/V
in place. One layer compiles in seconds where the whole 30-layer model took minutes per batch size.
Embedding, rotary tables, final norm and lm_head stay eager: one call each, and the lm_head runs only
on the rows that sample.

Shapes: a batch is padded to the capture sizes exactly as the CUDA path pads (`graphs/cuda.py`): padded
rows write to the null block and attend to one token there. The layer graph is compiled with dynamic
shapes (the token dimension only), so one compile serves every size but 1, which dynamo specializes
and compiles once more. Start-up
runs every size once, largest first, behind a progress bar; after that no step recompiles.

Compile cache: inductor's on-disk caches (FX graph, AOTAutograd, kernels) live under
`<asyncexec cache>/torch-compile` (`TORCHINDUCTOR_CACHE_DIR` unless the user set it), so a restart, a
spare worker or the next run loads compiled code instead of compiling it again.

Guard-free replay: dynamo checks a call's guards (hundreds, on the layer's parameters and inputs)
before it runs the compiled code, 60-110 us a call, 30 calls a step. Where start-up shows that the
guards cannot tell two of our calls of the same size class apart (every layer at every size hit one
compiled entry: one for size 1, one for the dynamic sizes, no graph break), a step calls the code dynamo
generated for that entry directly (captured by a bytecode hook, as vLLM's custom dispatcher does), which
runs the same compiled graph without evaluating guards. Otherwise (layers that compile differently, e.g.
per-layer sliding windows) steps go through dynamo and its guards.

Mixed and prefill steps (and decode batches above the largest size) of 2 tokens or more run a second
compiled layer graph, dynamic in the token dimension alone: the KV write is traced as in a decode step,
and the attention of every row (decode rows through the in-place kernel, prefill chunks through
`prefill_attention`) is one opaque op, `asyncexec::paged_attention_rows`, which finds the step's
chunks and tables at run time (`attention.mixed_step`), so no batch composition recompiles it. The
eager layers spent a third of such a step in unfused elementwise ops (RMSNorm, rotary, SiLU): on a
2-core AMX Xeon, smollm2 bf16, a 1,024-token prefill step of 5 prompts took 334 ms eager and 211 ms
compiled. It is warmed at start-up with 2 rows and goes through dynamo's guards (a few ms a step).

Numerics: inductor fuses a chain of bf16 (or fp16) elementwise ops into one loop in float32 and rounds
only its output, where eager rounds after every op (HF's RMSNorm, say, rounds the normalized row to bf16
before it multiplies by the weight). That is no less accurate, but it moves logits by an ulp here and
there, and a greedy near-tie then flips: SmolLM2's bare "What is the capital of France?" (its first
answer token 'The' leads 'L' by 2 bf16 ulps) answered "L'Étoile, la Marseillaise, ..." in bf16 graph mode
and "The capital of France is Paris." eager. So the graphs compile with `emulate_precision_casts`, which
rounds wherever eager does: a prefill step through the compiled graph then gives eager's logprobs to the
bit on a tiny llama (`test_cpu_graph.py`), where they moved by 0.003-0.007 on average without it. Cost on
a 2-core AMX Xeon, smollm2 bf16: none measurable on a decode step (32 rows 29.5-30.2 ms either way), a
1,024-token prefill 206-222 ms against 196-215 ms.
"""

from __future__ import annotations

import logging
import time
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.fx.experimental import _config as fx_config

from asyncexec import envs
from asyncexec.errors import ConfigError
from asyncexec.ops import paged_decode
from asyncexec.ops.build import compile_cache_dir
from asyncexec.ops.packed_linear import DedupeGroupLinears
from asyncexec.ops.paged_decode import decode_width, fresh_function
from asyncexec.worker.attention import MIXED_MIN_TOKENS, AttentionMetadata, mixed_step
from asyncexec.worker.input_batch import NULL_BLOCK

if TYPE_CHECKING:
    from asyncexec.worker.input_batch import InputBatch, PreparedBatch

__all__ = ["CPUGraphRunner", "CompiledLayers", "decoder_layers"]

logger = logging.getLogger(__name__)

# dynamo's generated code, per original code object (a runner's own copy of `_layer_forward`)
_generated: weakref.WeakKeyDictionary[types.CodeType, list[types.CodeType]] = weakref.WeakKeyDictionary()


def _on_bytecode(code: types.CodeType, new_code: types.CodeType) -> types.CodeType | None:
    sink = _generated.get(code)
    if sink is not None:
        sink.append(new_code)
    return None  # dynamo keeps the code it generated


torch._dynamo.convert_frame.register_bytecode_hook(_on_bytecode)


def decoder_layers(model: torch.nn.Module, num_layers: int) -> list[torch.nn.Module]:
    """The model's stack of decoder layers: the one ModuleList of `num_layers` entries of one class."""
    found = [
        list(mod)
        for mod in model.modules()
        if isinstance(mod, torch.nn.ModuleList)
        and len(mod) == num_layers
        and len({type(m) for m in mod}) == 1
    ]
    if len(found) != 1:
        raise ConfigError(
            f"{type(model).__name__}: cannot find its {num_layers} decoder layers to compile "
            f"({len(found)} candidates); use enforce_eager=True"
        )
    return found[0]


def _layer_forward(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(layer).forward(layer, *args, **kwargs)


def _mark_tokens(args: tuple[Any, ...], kwargs: dict[str, Any], md: AttentionMetadata) -> None:
    """Mark the token dimension dynamic (and nothing else: static dims give better loops, and
    dynamic=True would also let dynamo tie equal sizes together, e.g. a batch of 64 to head_dim 64,
    and recompile when they part)."""
    mark = torch._dynamo.maybe_mark_dynamic
    hidden = args[0] if args else kwargs.get("hidden_states")
    for t in (hidden, kwargs.get("position_ids"), *(kwargs.get("position_embeddings") or ())):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            mark(t, 1)  # [1, T, ...]
    for t in (md.slot_mapping, md.decode_block_tables, md.decode_seq_lens):
        mark(t, 0)
    torch._dynamo.mark_dynamic(md.decode_block_tables, 1)  # the width the longest row needs


def _mark_mixed(args: tuple[Any, ...], kwargs: dict[str, Any], md: AttentionMetadata) -> None:
    """A mixed step's layer graph: only the token dimension is dynamic (the rest of the step's shape is
    the attention op's business, at run time)."""
    mark = torch._dynamo.maybe_mark_dynamic
    hidden = args[0] if args else kwargs.get("hidden_states")
    for t in (hidden, kwargs.get("position_ids"), *(kwargs.get("position_embeddings") or ())):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            mark(t, 1)  # [1, T, ...]
    mark(md.slot_mapping, 0)


class CompiledLayers:
    """The decoder layers' two compiled graphs: decode steps (`compiled`, guard-free where start-up proves
    it safe) and mixed or prefill steps of 2 tokens or more (`compiled_mixed`, with dynamo's guards).
    Compiling is lazy: the first call of a size compiles it (`CPUGraphRunner.capture`). The `ModelRunner`
    swaps each layer's forward for `dispatch(layer)`."""

    def __init__(self) -> None:
        layer_fn = fresh_function(_layer_forward)  # a graph cache of its own
        self.generated: list[types.CodeType] = []  # dynamo's code for layer_fn, in compile order
        _generated[layer_fn.__code__] = self.generated
        self.layer_fn = layer_fn
        options: dict[str, Any] = {
            "post_grad_custom_post_pass": DedupeGroupLinears(),
            # round to bf16/fp16 wherever eager rounds (see the module docstring: "Numerics")
            "emulate_precision_casts": True,
        }
        self.compiled = torch.compile(layer_fn, options=options)
        self.compiled_mixed = torch.compile(fresh_function(_layer_forward), options=options)

    def dispatch(self, layer: torch.nn.Module) -> Callable[..., Any]:
        """`layer`'s new forward: the step's attention metadata picks its compiled graph, or eager."""
        eager, compiled, compiled_mixed = layer.forward, self.compiled, self.compiled_mixed

        def forward(*args: Any, **kwargs: Any) -> Any:
            md = kwargs.get("attn_metadata")
            if md is not None and md.mixed_graph:
                _mark_mixed(args, kwargs, md)
                return compiled_mixed(layer, *args, **kwargs)
            if md is None or not md.graph:
                return eager(*args, **kwargs)
            if md.layer_code is not None:  # the compiled entry's code, no guards (module docstring)
                return md.layer_code(layer, *args, **kwargs)
            _mark_tokens(args, kwargs, md)
            return compiled(layer, *args, **kwargs)

        return forward


def _size_class(b: int) -> int:
    return min(b, 2)  # dynamo specializes size 1; every other size shares the dynamic graph


class CPUGraphRunner:
    """The model's decoder layers compiled, and the decode steps that replay them; built by the
    `ModelRunner` that owns it (`capture_model`), from what it needs of it."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attention_modules: dict[int, torch.nn.Module],
        input_batch: InputBatch,
        sizes: list[int],
        layers: CompiledLayers,
        invariant: bool = False,
    ) -> None:
        # batch-invariant: every step, prefill chunks' tokens included, replays the one dynamic-size graph
        # at its own size, compiled at size 2 whatever the config (so its code is the same for every
        # engine) and size-oblivious, so a lone row needs no graph of its own (`capture`)
        self.invariant = invariant
        if invariant:
            sizes = [2]
        max_b = max(sizes)
        rows = max(
            max_b, 2, input_batch.max_num_tokens if invariant else 0
        )  # start-up also runs 2 rows eager
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = bs = input_batch.block_size
        self.sizes = sorted(sizes, reverse=True)
        self.guard_free = False  # the last replay called the compiled code without dynamo's guards
        self.input_ids = torch.zeros(rows, dtype=torch.int64)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        with torch.inference_mode(False):  # a normal tensor, as every step's slot mapping is (an input
            # batch buffer): the mixed steps' layer graph, warmed up with it, guards on that
            self.slots = torch.full((rows,), NULL_BLOCK * bs, dtype=torch.int64)
        self.block_tables = torch.full((rows, input_batch.max_blocks_per_seq), NULL_BLOCK, dtype=torch.int64)
        self.seq_lens = torch.ones(rows, dtype=torch.int64)
        self.padded = [0] * (max_b + 1)
        for n in range(1, max_b + 1):
            self.padded[n] = min(s for s in sizes if s >= n)
        self.capture_seconds = 0.0
        self.cache_dir = compile_cache_dir()
        # before compiling: the layer graph calls the C++ kernel if it built (the invariant mode: always)
        if envs.paged_decode_enabled() or invariant:
            paged_decode.load()
        else:
            logger.info("ASYNCEXEC_PAGED_DECODE=0: decode attention runs the inductor-compiled kernel")
        self.layers = layers
        # per size class: the generated code to call without guards; empty where that is not safe
        self.direct: dict[int, Callable[..., Any]] = {}
        attention = [attention_modules[i] for i in sorted(attention_modules)]
        for module, (k, v) in zip(attention, kv_caches, strict=True):
            module.register_buffer("k_cache", k, persistent=False)
            module.register_buffer("v_cache", v, persistent=False)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> CPUGraphRunner:
        """Compile (or load from the on-disk cache) and run every size once, largest first."""
        from tqdm.auto import tqdm

        start = time.perf_counter()
        bar = tqdm(self.sizes, desc="compiling decode graphs", unit="size", disable=not progress)
        per_size = {}
        for b in bar:
            bar.set_postfix(batch=b)
            before = len(self.layers.generated)
            # the invariant mode's one graph must also serve a lone row: compiled without dynamo's
            # specialization of sizes 0 and 1 (size-oblivious), it does, and is called for it without guards
            with fx_config.patch(backed_size_oblivious=self.invariant):  # type: ignore[attr-defined]
                self._forward(b, torch.arange(b), decode_width(1, self.block_size))
            per_size[b] = self.layers.generated[before:]
        self.direct = self._direct_codes(per_size)
        if self.invariant and _size_class(2) in self.direct:
            self.padded[1] = 1  # a lone row runs alone (else it pads to 2, which costs a lone stream)
        warm = () if self.invariant else (2, 1)  # (the invariant mode has no mixed steps)
        for b in warm:  # mixed steps' decode rows: the in-place kernel, one row and many; and with
            # 2 rows, the mixed steps' layer graph (2 tokens or more: one graph serves every mixed step)
            self._forward(b, torch.arange(b), decode_width(1, self.block_size), graph=False)
        self.capture_seconds = time.perf_counter() - start
        logger.info("compiled decode graphs for sizes %s in %.1f s (cache %s)", self.sizes,
                    self.capture_seconds, self.cache_dir)  # fmt: skip
        return self

    def _class(self, b: int) -> int:
        """The size class whose compiled code runs `b` rows (the invariant mode: one for every size)."""
        return _size_class(2) if self.invariant else _size_class(b)

    def _direct_codes(self, per_size: dict[int, list[types.CodeType]]) -> dict[int, Callable[..., Any]]:
        """Each size class's one generated code, where start-up proves it is the only entry dynamo would
        pick: every size's run (all layers) compiled at most one new entry, one per class, and that entry
        runs its graph without a graph break (a resume function would run eager without dynamo)."""
        codes: dict[int, types.CodeType] = {}
        for b in self.sizes:
            new, cls = per_size[b], _size_class(b)
            if len(new) > 1 or (new and cls in codes) or (not new and cls not in codes):
                logger.info(
                    "decode graphs: size %d compiled %d entries; steps keep dynamo's guards", b, len(new)
                )
                return {}
            if new:
                codes[cls] = new[0]
        if any(name.startswith("__resume") for code in codes.values() for name in code.co_names):
            logger.info("decode graphs: the layer graph breaks; steps keep dynamo's guards")
            return {}
        fn = self.layers.layer_fn
        return {
            cls: types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            for cls, code in codes.items()
        }

    def _forward(self, b: int, logits_indices: torch.Tensor, width: int, graph: bool = True) -> torch.Tensor:
        md = AttentionMetadata(
            self.kv_caches,
            self.slots[:b],
            b,
            self.block_tables[:b, :width].contiguous(),  # once a step, not in each layer's kernel
            self.seq_lens[:b],
        )
        md.graph, md.inplace_decode = graph, not graph
        md.mixed_graph = not graph and b >= MIXED_MIN_TOKENS
        md.layer_code = self.direct.get(self._class(b)) if graph else None
        with mixed_step(md):
            out: Any = self.model(
                input_ids=self.input_ids[:b][None],
                position_ids=self.positions[:b][None],
                use_cache=False,
                logits_to_keep=logits_indices,
                attn_metadata=md,
            )
        return out.logits[0]  # type: ignore[no-any-return]

    def replay(self, batch: PreparedBatch) -> torch.Tensor | None:
        """Logits of the rows that sample, or None where no compiled size fits this batch."""
        n, bs = batch.num_decodes, self.block_size
        if n >= len(self.padded) and not self.invariant:
            return None
        b = self.padded[n] if n < len(self.padded) else n  # (invariant: the dynamic graph takes any size)
        width = batch.decode_block_tables.shape[1]  # the longest row's blocks
        self.input_ids[:n] = batch.input_ids
        self.positions[:n] = batch.positions
        self.slots[:n] = batch.slot_mapping
        self.seq_lens[:n] = batch.decode_seq_lens
        self.block_tables[:n, :width] = batch.decode_block_tables
        self.block_tables[:n, width:].fill_(NULL_BLOCK)
        self.slots[n:b].fill_(NULL_BLOCK * bs)
        self.seq_lens[n:b].fill_(1)
        self.block_tables[n:b].fill_(NULL_BLOCK)
        self.guard_free = self._class(b) in self.direct
        return self._forward(b, batch.logits_indices, decode_width(width * bs, bs))
