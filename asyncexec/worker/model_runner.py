"""`ModelRunner`: a transformers causal LM on asyncexec's paged KV cache.

One step: `InputBatch.update_states` (deltas) -> `InputBatch.prepare` (flat inputs in preallocated
buffers) -> graph replay for a uniform decode batch that fits a captured size (the runner's own graph
runner, built by `capture_model`), else the eager forward -> sample (a speculative row: every position,
then its drafts verified, `spec_verify`) -> `ModelRunnerOutput`.

The forward is one flattened call: `input_ids [1, T]`, explicit `position_ids [1, T]` (RoPE and GPT-2's
absolute positions need them), `use_cache=False` (no DynamicCache), `logits_to_keep` = the last token of
every row that samples (every token of a verify row), and the step's `AttentionMetadata` as a kwarg that
reaches every layer.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import torch

from asyncexec.config import EngineConfig
from asyncexec.errors import ConfigError
from asyncexec.gguf.file import GGUFFile, is_gguf, load_hf_config
from asyncexec.gguf.loader import load_gguf_model
from asyncexec.messages import Logprobs, ModelRunnerOutput, SchedulerOutput
from asyncexec.quantization.int8 import activation_scales
from asyncexec.quantization.int8 import gemm_serves as int8_gemm_serves
from asyncexec.quantization.pack import check_quantization, pack_linears
from asyncexec.worker.attention import MIXED_MIN_TOKENS, AttentionMetadata, mixed_step, register_attention
from asyncexec.worker.input_batch import NULL_BLOCK, InputBatch, PreparedBatch
from asyncexec.worker.memory import FileMappings, drop_file_pages, own_weights, trim_heap
from asyncexec.worker.model_checks import auto_dtype, check_architecture, model_max_len
from asyncexec.worker.prompt_logprobs import PromptLogprobsRows
from asyncexec.worker.sampler import Sampler
from asyncexec.worker.spec_verify import accepted_tokens, draft_histories

__all__ = ["NULL_BLOCK", "ModelRunner"]


logger = logging.getLogger(__name__)

PROFILE_TOKENS_CPU = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, world_size: int, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = device
        self.world_size = world_size
        self.model: Any = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_spec: dict[int, tuple[int, int, torch.dtype]] = {}
        self.sampler = Sampler(config.seed)
        self.graphs: Any = None  # a CUDAGraphRunner or CPUGraphRunner once captured
        self.compiled_layers: Any = None  # CPU graph mode: the decoder layers' graphs (`_patch_model`)
        self.inplace_decode = False  # eager decode rows use the compiled in-place kernel (CPU graph mode)
        self.attention_modules: dict[int, torch.nn.Module] = {}
        self.stats = {
            "steps": 0,
            "graph_steps": 0,
            "guard_free_steps": 0,
            "mixed_graph_steps": 0,
            "forward_s": 0.0,
            "sample_s": 0.0,
            "execute_s": 0.0,
        }

    # ----- loading --------------------------------------------------------------------------------

    def load_model(self) -> None:
        path = self.config.model
        assert path is not None
        gguf = is_gguf(path)
        opened = GGUFFile.open(path) if gguf else None  # its header is parsed once here (seconds)
        if not gguf and not os.path.isdir(path):
            raise ConfigError(
                f"model folder {path!r} does not exist (asyncexec loads local folders and GGUF files only)"
            )
        hf_config = load_hf_config(path, opened)
        arch = check_architecture(hf_config, self.world_size)
        self.hf_config = hf_config
        self.arch = arch
        self.max_model_len = self.config.max_model_len or model_max_len(hf_config)
        if self.max_model_len > model_max_len(hf_config):
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds {arch}'s {model_max_len(hf_config)}"
            )
        self.dtype = self._dtype(hf_config)
        if self.config.batch_invariant and self.device.type != "cpu":
            raise ConfigError(
                f"batch_invariant=True runs on CPU only; this rank's device is {self.device.type}"
            )
        check_quantization(self.config.quantization, self.device, self.dtype)
        self.gguf_sources: dict[torch.nn.Module, Any] = {}
        if opened is not None:
            self._load_gguf(path, opened)
            del opened
        else:
            self._load_folder(path)
        self.model.eval()
        self._patch_model(path)
        own_weights(self.model)  # out of the checkpoint's memory map (embedding tables: their pages dropped)
        self.gguf_sources = {}
        trim_heap()  # the load's bf16 weights, calibration and packing are freed: give the pages back
        bs = self.config.block_size
        spec = self.config.speculative_config
        self.input_batch = InputBatch(
            self.config.max_num_batched_tokens,
            self.config.max_num_seqs,
            math.ceil(self.max_model_len / bs),
            bs,
            self.config.max_num_seqs * (1 + spec.num_speculative_tokens) if spec else None,
            decode_rows_only=self.config.batch_invariant,
        )

    def _load_folder(self, path: str) -> None:
        import transformers

        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if self.world_size > 1:  # transformers' own tensor parallelism: its tp plan, our process group
            try:
                from transformers.distributed import DistributedConfig

                kwargs["distributed_config"] = DistributedConfig(tp_size=self.world_size)
            except ImportError:  # transformers < 4.54
                kwargs["tp_plan"] = "auto"
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if self.world_size == 1:
            self.model.to(self.device)

    def _load_gguf(self, path: str, opened: GGUFFile) -> None:
        """A GGUF file, tensor by tensor (`gguf.loader`): with `dtype="auto"` and no `quantization`, its
        quantized tensors stay as they ship where a GEMM serves them; else every tensor is dequantized to
        the dtype (then quantized again if `quantization` says so)."""
        if self.world_size > 1:
            raise ConfigError(
                f"GGUF files load on one rank (tensor_parallel_size=1); got tensor_parallel_size="
                f"{self.world_size} for {path!r}"
            )
        keep = self.config.dtype == "auto" and self.config.quantization is None and self.device.type == "cpu"
        start = time.perf_counter()
        loaded = load_gguf_model(path, self.dtype, keep, progress=self.rank == 0, opened=opened)
        self.model = loaded.model.to(self.device)
        self.gguf_sources = loaded.sources
        logger.info("%s: %s, read in %.1f s", os.path.basename(path), loaded.summary(),
                    time.perf_counter() - start)  # fmt: skip

    def _patch_model(self, path: str) -> None:
        """Every change asyncexec makes to the transformers model it loaded, here and in this order:
        1. attention: every layer calls `attention.paged_attention` (registered with transformers'
           `AttentionInterface`), which reads and writes the paged KV cache;
        2. linears (CPU, quantized or graph mode): each `nn.Linear`'s forward runs the prepacked (or
           int8/int4) weights through `asyncexec::packed_linear`; after tensor-parallel sharding, so
           each rank packs its own shard;
        3. decoder layers (CPU graph mode): each layer's forward picks its compiled graph
           (`graphs.cpu.CompiledLayers.dispatch`) or eager, by the step's attention metadata."""
        self.model.set_attn_implementation(register_attention())
        cpu = self.device.type == "cpu"
        invariant = self.config.batch_invariant
        if cpu and (
            self.config.quantization or not self.config.enforce_eager or self.gguf_sources or invariant
        ):
            mappings = FileMappings()  # the checkpoint's: each weight's pages go once it is packed
            done = pack_linears(self.model, self.config.quantization, input_scales=self._int8_scales(path),
                                release=lambda w: drop_file_pages(w, mappings),
                                sources=self.gguf_sources, batch_invariant=invariant)  # fmt: skip
            if done.get("rowwise") and self.rank == 0:
                logger.warning("batch_invariant: %d linears have no kernel whose sums are the same for "
                               "every number of rows on this CPU (bf16 needs AVX-512 BF16, int8/int4 AVX-512 "
                               "VNNI); they multiply one row at a time, slower", done["rowwise"])  # fmt: skip
        if cpu and self._cpu_graph_mode():
            from asyncexec.worker.graphs.cpu import CompiledLayers, decoder_layers

            self.compiled_layers = CompiledLayers()
            for layer in decoder_layers(self.model, self.hf_config.get_text_config().num_hidden_layers):
                layer.forward = self.compiled_layers.dispatch(layer)

    def _cpu_graph_mode(self) -> bool:
        """Graph mode on CPU compiles C++: without a working compiler, eager serves (rank 0 says why)."""
        if self.config.enforce_eager:
            return False
        from asyncexec.ops.build import compiler_missing

        missing = compiler_missing()
        if missing is not None and self.rank == 0:
            logger.warning(
                "graph mode needs a C++ compiler and none works here (%s); running eager, slower: "
                "install g++ (or point CXX at a compiler), or pass enforce_eager=True to say so",
                missing,
            )
        return missing is None

    def _int8_scales(self, path: str) -> dict[torch.nn.Linear, torch.Tensor] | None:
        """int8's activation-aware scales (one calibration forward); plain int8 under tensor parallelism,
        where each rank holds a shard of the activations, and where the int8 GEMM serves every linear: with
        a scale per group of 32 the scales measured no gain on SmolLM2 (argmax agreement with bf16 96.1%
        with and without), and the search took minutes at 1B (`quantization.int8`)."""
        if self.config.quantization != "int8":
            return None
        if self.world_size > 1:
            logger.info("int8 under tensor parallelism: plain per-channel scales (no calibration)")
            return None
        if all(int8_gemm_serves(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Linear)):
            logger.info("int8 with a scale per group of 32 (Q8_0) needs no calibration")
            return None
        return activation_scales(self.model, path)

    def _dtype(self, hf_config: Any) -> torch.dtype:
        if self.config.dtype != "auto":
            return _DTYPES[self.config.dtype]
        assert self.config.model is not None
        return _DTYPES[auto_dtype(self.config.model, hf_config)]

    # ----- memory ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A dummy forward; records the KV shapes each layer sees. On CUDA it runs at
        `max_num_batched_tokens`, whose activation peak sizes the KV cache; on CPU the cache is sized
        without a peak, so a few tokens do (a 2048-token forward of a 135M model takes 10-16 s there,
        which every start and every restart paid)."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        if self.device.type != "cuda":
            n = min(n, PROFILE_TOKENS_CPU)
        md = AttentionMetadata([], torch.empty(0, dtype=torch.int64), 0, torch.empty(0), torch.empty(0))
        md.profiling = True
        ids = torch.zeros(1, n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)[None]
        self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1, attn_metadata=md)
        if md.calls == 0:
            raise ConfigError(
                f"{self.arch} never called the registered attention function; it cannot run here"
            )
        self.kv_spec = dict(sorted(md.seen.items()))
        self.attention_modules = dict(sorted(md.modules.items()))

    def kv_cache_block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V, on this rank."""
        bs = self.config.block_size
        return sum(
            2 * bs * h * d * torch.empty(0, dtype=dt).element_size() for h, d, dt in self.kv_spec.values()
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if not self.kv_spec:
            raise RuntimeError("profile_run must run before the KV cache is allocated")
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks (block 0 is the null block), got {num_blocks}"
            )
        bs = self.config.block_size
        with torch.inference_mode():  # inference tensors, like every step's (paged_decode.attend_decode)
            self.kv_caches = [
                (
                    torch.zeros(num_blocks, bs, h, d, dtype=dt, device=self.device),
                    torch.zeros(num_blocks, bs, h, d, dtype=dt, device=self.device),
                )
                for h, d, dt in self.kv_spec.values()
            ]
        self.num_blocks = num_blocks
        if self.config.batch_invariant:
            self._check_decode_kernel()
        logger.info("allocated %d KV blocks of %d tokens (%.1f MiB)", num_blocks, bs,
                    num_blocks * self.kv_cache_block_bytes() / 2**20)  # fmt: skip

    def _check_decode_kernel(self) -> None:
        """The batch-invariant mode attends every token through the C++ paged decode kernel (each row's
        keys summed in one order, `ops.paged_decode`): refuse where it cannot serve this model."""
        from asyncexec.ops import paged_decode

        heads = self.hf_config.get_text_config().num_attention_heads // self.world_size
        k_cache = self.kv_caches[0][0]
        q = torch.empty(1, heads, k_cache.shape[3], dtype=k_cache.dtype)
        if not (paged_decode.load() and paged_decode.serves(q, k_cache)):
            raise ConfigError(
                f"batch_invariant=True needs asyncexec's paged decode kernel, which does not serve "
                f"{self.arch} here ({heads} query heads, KV {tuple(k_cache.shape[2:])}, {k_cache.dtype}, or "
                "it could not build: see the log)"
            )

    # ----- graphs ---------------------------------------------------------------------------------

    def capture_model(self, progress: bool = True) -> None:
        """Graph mode, unless `enforce_eager`: CUDA graphs on CUDA; on CPU, the decoder layers compiled at
        load (`_patch_model`), run once per capture size, and the in-place decode kernel for eager
        steps' decode rows."""
        if self.config.enforce_eager:
            return
        sizes = self.config.capture_sizes
        if self.device.type == "cuda":
            from asyncexec.worker.graphs.cuda import CUDAGraphRunner

            self.graphs = CUDAGraphRunner(self.model, self.kv_caches, self.input_batch, sizes).capture()
        elif self.compiled_layers is not None:
            from asyncexec.worker.graphs.cpu import CPUGraphRunner

            self.graphs = CPUGraphRunner(
                self.model, self.kv_caches, self.attention_modules, self.input_batch, sizes,
                self.compiled_layers, self.config.batch_invariant,
            ).capture(progress)  # fmt: skip
            self.inplace_decode = True
        trim_heap()

    # ----- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if not self.kv_caches:
            raise RuntimeError("the KV cache is not initialized: call initialize_kv_cache first")
        start = time.perf_counter()
        self.input_batch.update_states(so)
        self.sampler.update_states(so)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput([], [])
        batch = self.input_batch.prepare(so)
        num_prompt = self.sampler.num_prompt_tokens
        prompt_rows = PromptLogprobsRows.build(so, batch, self.input_batch.requests, num_prompt)
        if prompt_rows is not None:  # their logits follow the sampling rows'
            batch = prompt_rows.extend(batch)
        t = time.perf_counter()
        logits = self._forward(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_sample = time.perf_counter()
        self.stats["forward_s"] += t_sample - t
        rows, counts = batch.sample_rows, batch.sample_counts
        ids = [batch.req_ids[r] for r in rows]
        states = [self.input_batch.requests[rid] for rid in ids]
        params, positions, histories, prompt_lens, row_ids = [], [], [], [], []
        for rid, st, m in zip(ids, states, counts, strict=True):  # a verify row samples 1 + k rows
            hist = (
                draft_histories(st.token_ids, st.spec_token_ids) if st.sampling_params.needs_history else None
            )
            for j in range(m):
                params.append(st.sampling_params)
                positions.append(len(st.token_ids) + j)
                histories.append(st.token_ids if hist is None else hist[j])
                prompt_lens.append(num_prompt.get(rid, len(st.token_ids)))
                row_ids.append(rid)
        num_logits = len(params)
        sampled, logprobs = self.sampler(
            logits[:num_logits], params, positions, histories, prompt_lens, req_ids=row_ids
        )
        self.stats["sample_s"] += time.perf_counter() - t_sample
        prompt_lps = prompt_rows.gather(logits[num_logits:]) if prompt_rows is not None else {}
        per_row: list[list[int]] = [[] for _ in batch.req_ids]
        kept: list[int] = []  # the sampler rows whose tokens are emitted, requests in order
        at = 0
        for r, st, m in zip(rows, states, counts, strict=True):
            toks = accepted_tokens(st.spec_token_ids, sampled[at : at + m]) if m > 1 else sampled[at : at + 1]
            per_row[r] = toks
            kept.extend(range(at, at + len(toks)))
            at += m
        self.input_batch.append_sampled(ids, [per_row[r] for r in rows])
        self.stats["steps"] += 1
        self.stats["execute_s"] += time.perf_counter() - start
        return ModelRunnerOutput(batch.req_ids, per_row, _rows(logprobs, kept), prompt_lps)

    def _forward(self, b: PreparedBatch) -> torch.Tensor:
        if self.graphs is not None and not b.prefills:  # decode rows only (verify rows included)
            logits: torch.Tensor | None = self.graphs.replay(b)
            if logits is not None:
                self.stats["graph_steps"] += 1
                self.stats["guard_free_steps"] += self.graphs.guard_free  # the last replay's
                return logits
        dev = self.device
        md = AttentionMetadata(
            self.kv_caches,
            b.slot_mapping.to(dev, non_blocking=True),
            b.num_decodes,
            b.decode_block_tables.to(dev, non_blocking=True),
            b.decode_seq_lens.to(dev, non_blocking=True),
            b.prefills,
            [blk.to(dev, non_blocking=True) for blk in b.prefill_block_ids],
            b.decode_buckets,
        )
        md.inplace_decode = self.inplace_decode or self.config.batch_invariant
        # CPU graph mode: the layers of a mixed or prefill step run their own compiled graph
        md.mixed_graph = self.inplace_decode and len(b.input_ids) >= MIXED_MIN_TOKENS
        self.stats["mixed_graph_steps"] += md.mixed_graph
        with mixed_step(md):
            out = self.model(
                input_ids=b.input_ids.to(dev, non_blocking=True)[None],
                position_ids=b.positions.to(dev, non_blocking=True)[None],
                use_cache=False,
                logits_to_keep=b.logits_indices.to(dev, non_blocking=True),
                attn_metadata=md,
            )
        result: torch.Tensor = out.logits[0]
        return result


def _rows(lp: Logprobs | None, rows: list[int]) -> Logprobs | None:
    """The logprobs of the sampler rows `rows` only (the emitted tokens'), in that order."""
    if lp is None or len(rows) == len(lp.token_ids):
        return lp
    return Logprobs(
        [lp.token_ids[i] for i in rows],
        [lp.logprobs[i] for i in rows],
        [lp.sampled_token_ranks[i] for i in rows],
    )
