"""Compare the grammar engines that structured outputs could use, on the real model's tokenizer.

For each installed library among xgrammar, llguidance and outlines-core:
- tokenizer set-up: building its view of the vocabulary from the HF tokenizer (once per engine);
- compile: a 20-field JSON schema, cold (median of `--repeats` fresh compiles, no cache);
- mask: filling the packed int32 bitmask of 32 constrained rows, per step, and advancing each matcher
  with a token it allows (median and p90 over `--steps` steps of a walk through the grammar).
Each row walks its own path (a seeded random allowed token each step, the first allowed one for the
last few), so the 32 matchers are in different states, as in a real batch.
Usage: python scripts/bench_grammar.py [--model smollm2] [--libs xgrammar llguidance outlines-core]
       [--rows 32] [--steps 60] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import abc
import argparse
import importlib.metadata
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "country": {"type": "string"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "phone": {"type": "string"},
        "created": {"type": "string"},
        "updated": {"type": "string"},
        "height": {"type": "number"},
        "weight": {"type": "number"},
        "verified": {"type": "boolean"},
        "level": {"type": "integer"},
        "notes": {"type": "string"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "number": {"type": "integer"}},
            "required": ["street", "number"],
        },
    },
    "required": ["id", "name", "email", "age", "active", "score", "tags", "role", "country", "city",
                 "zip", "phone", "created", "updated", "height", "weight", "verified", "level", "notes",
                 "address"],
}  # fmt: skip


class Lib(abc.ABC):
    """One library behind a common shape: `setup`, `compile`, and 32 matchers filled and advanced."""

    name = ""
    dist = ""

    @abc.abstractmethod
    def setup(self, tokenizer: Any, vocab_size: int) -> None: ...
    @abc.abstractmethod
    def compile(self, schema: str) -> Any: ...
    @abc.abstractmethod
    def matchers(self, compiled: Any, n: int) -> list[Any]: ...
    @abc.abstractmethod
    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    @abc.abstractmethod
    def advance(self, matcher: Any, token: int) -> None: ...


class XGrammar(Lib):
    name, dist = "xgrammar", "xgrammar"

    def setup(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)

    def compile(self, schema: str) -> Any:
        return self.xgr.GrammarCompiler(self.info, cache_enabled=False).compile_json_schema(schema)

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)


class LLGuidance(Lib):
    name, dist = "llguidance", "llguidance"

    def setup(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: str) -> Any:
        # llguidance builds its lexer lazily: the first mask is part of the compile, as in use.
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        m.compute_bitmask()
        return grammar

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.llg.LLMatcher(self.tok, compiled) for _ in range(n)]

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class OutlinesCore(Lib):
    name, dist = "outlines-core", "outlines-core"

    def setup(self, tokenizer: Any, vocab_size: int) -> None:
        import outlines_core

        self.oc = outlines_core
        decoder = {c: b for b, c in _bytes_to_unicode().items()}
        vocab: dict[bytes, list[int]] = {}
        eos = tokenizer.eos_token_id
        for token, tid in tokenizer.get_vocab().items():
            if tid == eos:
                continue
            raw = bytes(decoder[c] for c in token) if all(c in decoder for c in token) else token.encode()
            vocab.setdefault(raw, []).append(tid)
        self.vocab = outlines_core.Vocabulary(eos, vocab)

    def compile(self, schema: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(schema)
        return self.oc.Index(regex, self.vocab)

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        return [self.oc.Guide(compiled) for _ in range(n)]

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.write_mask_into(bitmask[i].data_ptr(), bitmask[i].numel(), bitmask.element_size())

    def advance(self, matcher: Any, token: int) -> None:
        matcher.advance(token)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (the one SmolLM2's BPE uses): byte -> the character it shows as."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


LIBS: dict[str, Callable[[], Lib]] = {
    "xgrammar": XGrammar,
    "llguidance": LLGuidance,
    "outlines-core": OutlinesCore,
}


def allowed(row: torch.Tensor, vocab_size: int) -> list[int]:
    bits = (row.view(torch.int32)[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    ids = bits.reshape(-1)[:vocab_size].nonzero().flatten()
    return [int(i) for i in ids]


def measure(lib: Lib, tokenizer: Any, vocab: int, rows: int, steps: int, repeats: int) -> dict[str, Any]:
    t = time.perf_counter()
    lib.setup(tokenizer, vocab)
    setup_s = time.perf_counter() - t
    schema = json.dumps(SCHEMA)
    compiles = []
    compiled = None
    for _ in range(repeats):
        t = time.perf_counter()
        compiled = lib.compile(schema)
        compiles.append(time.perf_counter() - t)
    matchers = lib.matchers(compiled, rows)
    bitmask = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32)
    rngs = [random.Random(i) for i in range(rows)]
    fills, advances = [], []
    eos = tokenizer.eos_token_id
    for step in range(steps):
        bitmask.fill_(0)
        t = time.perf_counter()
        lib.fill(matchers, bitmask)
        fills.append(time.perf_counter() - t)
        picks = []
        for i in range(rows):
            ok = [x for x in allowed(bitmask[i], vocab) if x != eos] or [eos]
            picks.append(ok[0] if step > steps * 3 // 4 else rngs[i].choice(ok))
        t = time.perf_counter()
        for m, tok in zip(matchers, picks, strict=True):
            if tok != eos:
                lib.advance(m, tok)
        advances.append(time.perf_counter() - t)
    fills.sort()
    return {
        "version": importlib.metadata.version(lib.dist),
        "tokenizer_setup_s": round(setup_s, 3),
        "compile_20_field_schema_ms": round(statistics.median(compiles) * 1e3, 2),
        f"mask_fill_{rows}_rows_ms_p50": round(statistics.median(fills) * 1e3, 3),
        f"mask_fill_{rows}_rows_ms_p90": round(fills[int(len(fills) * 0.9)] * 1e3, 3),
        f"advance_{rows}_rows_ms_p50": round(statistics.median(advances) * 1e3, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--libs", nargs="+", default=list(LIBS), choices=list(LIBS))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from asyncexec.gguf.file import load_hf_config, load_tokenizer
    from asyncexec.model_registry import resolve_model

    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    vocab = load_hf_config(path).vocab_size
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name in args.libs:
        try:
            results[name] = measure(LIBS[name](), tokenizer, vocab, args.rows, args.steps, args.repeats)
        except ImportError as e:
            results[name] = {"error": f"not installed: {e}"}
        print(name, json.dumps(results[name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rows": args.rows, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
