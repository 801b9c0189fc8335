"""Engine configuration: frozen dataclasses, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Flat keyword arguments of ``LLM`` / command-line flags -> SpeculativeConfig fields. The one place
# that names them: ``llm.build_engine_config`` and ``args.add_engine_args`` both read it.
SPECULATIVE_ARGS = {
    "num_draft_tokens": "num_draft_tokens",
    "ngram_match_type": "match_type",
    "ngram_max_bfs_breadth": "max_bfs_breadth",
    "ngram_min_bfs_breadth": "min_bfs_breadth",
    "ngram_max_trie_depth": "max_trie_depth",
    "ngram_capacity": "capacity",
    "spec_threshold_single": "threshold_single",
    "spec_threshold_acc": "threshold_acc",
    "spec_policy": "policy",
    "spec_threshold_match": "threshold_match",
    "ngram_index_prompt": "index_prompt",
    "spec_grammar_drafts": "grammar_drafts",
    "spec_field_memory": "field_memory",
    "draft_corpus": "draft_corpus",
    "draft_corpus_max_tokens": "draft_corpus_max_tokens",
    "draft_corpus_max_count": "draft_corpus_max_count",
}


def _opt(default: Any, help: str, choices: list[str] | None = None, flag: str | None = None) -> Any:
    """A field with the help text, choices and (when not its own name) the name of its command-line
    flag (``args.add_engine_args``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


@dataclass(frozen=True)
class SpeculativeConfig:
    """NGRAM tree speculation (no draft model). D = ``num_draft_tokens`` counts the root node."""

    num_draft_tokens: int = _opt(8, "draft tree size D, root included")
    match_type: str = _opt("BFS", "BFS: recent continuations first; PROB: frequent ones", ["BFS", "PROB"])
    max_bfs_breadth: int = 10
    min_bfs_breadth: int = 1
    max_trie_depth: int = 18
    capacity: int = _opt(1_000_000, "n-gram trie nodes")
    threshold_single: float = _opt(1.0, "1.0 (with threshold_acc 1.0) = lossless target sampling")
    threshold_acc: float = 1.0
    policy: str = _opt(
        "adaptive",
        "draft width per step: adaptive (measured costs and learned acceptance), threshold "
        "(D when a match of threshold_match tokens exists, else plain) or fixed (always D)",
        ["adaptive", "threshold", "fixed"],
    )
    threshold_match: int = _opt(2, "the threshold policy's shortest match worth a verify step")
    index_prompt: bool = _opt(True, "prompts feed the corpus at admission (prompt copying)")
    grammar_drafts: bool = _opt(
        True,
        "under a grammar, draft the text it forces (hedged tokenizations) and the prompt's text where "
        "token windows cannot match, refill the drafts it forbids and extend branches "
        "(speculative/proposer.py); off: n-gram drafts only, pruned",
    )
    field_memory: int = _opt(4096, "JSON values remembered per (schema, path) for drafting, in all (0: off)")
    draft_corpus: tuple[str, ...] = _opt((), "text or JSONL files indexed as named external draft corpora")
    draft_corpus_max_tokens: int = _opt(2_000_000, "largest external draft corpus, in tokens")
    draft_corpus_max_count: int = _opt(16, "most external draft corpora at once (start-up and run time)")

    def __post_init__(self) -> None:
        if isinstance(self.draft_corpus, str):  # tuple("a.txt") would be five one-letter paths
            raise ValueError("draft_corpus is a list of files, got a string")
        object.__setattr__(self, "draft_corpus", tuple(self.draft_corpus))
        if self.draft_corpus_max_count < 0:
            raise ValueError(f"draft_corpus_max_count must be >= 0, got {self.draft_corpus_max_count}")
        if self.field_memory < 0:
            raise ValueError(f"spec_field_memory must be >= 0, got {self.field_memory}")
        if self.draft_corpus_max_tokens < 1:
            raise ValueError("draft_corpus_max_tokens must be positive")
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"num_draft_tokens must be in [1, 64], got {self.num_draft_tokens}")
        if self.match_type not in ("BFS", "PROB"):
            raise ValueError(f"ngram_match_type must be 'BFS' or 'PROB', got {self.match_type!r}")
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            raise ValueError("need 1 <= ngram_min_bfs_breadth <= ngram_max_bfs_breadth")
        if self.max_trie_depth < 2:
            raise ValueError("ngram_max_trie_depth must be >= 2")
        if self.capacity < 1:
            raise ValueError("ngram_capacity must be positive")
        if self.policy not in ("adaptive", "threshold", "fixed"):
            raise ValueError(f"spec_policy must be adaptive, threshold or fixed, got {self.policy!r}")
        if self.threshold_match < 1:
            raise ValueError(f"spec_threshold_match must be >= 1, got {self.threshold_match}")
        if not (0 < self.threshold_acc <= 1 and 0 <= self.threshold_single <= 1):
            raise ValueError("thresholds must be in (0, 1]")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _opt(None, "GGUF file or Hugging Face folder (default: embedded SmolLM2-135M)")
    device: str = _opt("auto", "cpu, cuda, cuda:N or auto")
    dtype: str = _opt("auto", "float32, bfloat16, float16 or auto")
    # Weight-only 4-bit projections on a CPU (model/quant.py), one kernel at every row count.
    # auto: on a CPU with dtype auto, the model's own 4-bit (GGUF Q4_0 / Q4_1) weights, or a notice
    # that it has none; otherwise none. An explicit dtype keeps its weights.
    quantization: str = _opt(
        "auto",
        "int4: 4-bit weights (a GGUF's own, else quantized at load; CPU only); none: the checkpoint's "
        "weights in dtype; auto: int4 on a CPU when dtype is auto and the model has 4-bit weights",
        ["auto", "none", "int4"],
    )
    # vLLM's ``--load-format dummy``: time a large model's shape with no checkpoint to read (its
    # outputs are noise; benchmarks pair it with recorded outputs, speculative/replay.py).
    load_format: str = _opt(
        "auto",
        "auto: the checkpoint's weights; dummy: seeded random weights of its architecture (only "
        "config.json and the tokenizer are read; for benchmarks)",
        ["auto", "dummy"],
    )
    page_size: int = _opt(16, "KV page size in tokens (a power of two)")
    kv_cache_tokens: int | None = _opt(None, "KV pool size in tokens (default: from memory)")
    gpu_memory_utilization: float = _opt(0.5, "share of free GPU memory for the KV pool")
    cpu_kv_cache_tokens: int = _opt(65536, "KV pool size in tokens on a CPU")
    max_running_requests: int = _opt(256, "largest running batch (sequences decoding together)")
    max_prefill_tokens: int = _opt(2048, "prefill tokens per step; longer prompts are prefilled in chunks")
    max_model_len: int | None = _opt(None, "context length (default: the model's)")
    prefix_cache: bool = _opt(True, "share the KV pages of common prompt prefixes across requests")
    mixed_steps: bool = _opt(True, "prefill chunks ride along with running requests' decode steps")
    # A prefill chunk costs a decode step's time at about this many tokens: 512 on a GPU; on a CPU a
    # forward's cost grows with its tokens from the first, and 64 keeps a mixed step near 2 plain ones.
    # Counted beside the decode rows: a budget shared with them starved admissions at large batches
    # (256 streams left 256 prompt tokens per step for ~400 arriving), so the batch shrank.
    mixed_step_tokens: int | None = _opt(
        None,
        "prompt tokens a mixed step prefills beside its decode rows (default: 512 on CUDA, 64 on a CPU)",
    )
    # On a GPU a mixed step costs a graphed decode step plus its eager attention launches (a fixed
    # host cost), so prompts arriving one or two per step are better gathered into one mixed step
    # every few steps than taken into every step; on a CPU a step's cost follows its tokens.
    prefill_wait_steps: int | None = _opt(
        None,
        "decode steps an arriving prompt may wait to share one mixed step with others (default: 4 on CUDA, 0 on a CPU)",
    )
    attention_backend: str = _opt("auto", "attention kernels", ["auto", "sdpa", "triton"])
    # Lossless by default: with row-invariant kernels a token's logits are the same whether it is
    # decoded alone, in a batch, in a verify tree or in a prefill chunk (model/ops.py, attention).
    numerics: str = _opt(
        "auto",
        "CUDA kernels. invariant: a token's logits do not depend on the step it is computed in (batch, "
        "verify tree, prefill chunk), so batching and speculation never change greedy output; fast: "
        "per-shape kernels (cuBLAS, tuned attention tiles), whose output may change with the batch; "
        "auto: invariant on one CUDA device with Triton attention, else fast (CPU kernels are "
        "row-invariant in their own right)",
        ["auto", "invariant", "fast"],
    )
    speculative: SpeculativeConfig | None = None
    seed: int = _opt(0, "seeds requests that bring none", flag="engine_seed")
    grammar_cache_size: int = _opt(256, "compiled grammars cached (also bounded by grammar_cache_mb)")
    grammar_cache_mb: int = _opt(
        1024, "memory of the compiled grammars cached, MiB (as xgrammar measures it)"
    )
    cuda_graph: bool = _opt(True, "replay captured CUDA graphs for decode / verify steps (off: run eagerly)")
    cuda_graph_max_bs: int = _opt(256, "largest batch-size bucket captured; bigger batches run eagerly")
    # Launch a plain decode step before the previous one is read back, so the host's work overlaps
    # the device. None: on for CUDA; on a CPU the forward is synchronous and there is nothing to hide.
    overlap_schedule: bool | None = _opt(
        None, "launch each plain step before reading the last back (auto: CUDA)"
    )
    # Leave an NGRAM verify step in flight: the next engine step commits it first thing, so the
    # outputs and the corpus' drafts for the likely outcome run while the device verifies.
    # None: with overlap_schedule (CUDA).
    pipeline_verify: bool | None = _opt(
        None, "commit each verify step in the next engine step, drafting ahead meanwhile (auto: overlap)"
    )
    # A plain step chained out of a pipelined verify step from its device result (engine.py). Off by
    # default: it does not pay until the guess of when a plain step follows a verify step
    # (``NgramSpecWorker.chain_after_verify``) is right more often (benchmarks/results/LOG.md).
    chain_verify: bool = _opt(
        False, "launch a plain step out of a pipelined verify step before reading its result back"
    )
    # A verify step chained out of a plain step still in flight (engine.py): drafted one token
    # behind, its trees picked on the device by that token. Off by default until the GPU has timed
    # it against draining (benchmarks/results/LOG.md); free-text batches only.
    chain_into_verify: bool = _opt(
        False, "launch a verify step from a plain step still in flight, its trees drafted one token behind"
    )
    # Parallelism (ngrammar/distributed/): one process per tensor-parallel rank, rank 0 the engine;
    # data-parallel replicas are whole engines (each tensor_parallel_size ranks) behind one server.
    tensor_parallel_size: int = _opt(1, "tensor-parallel ranks (one process and device each)", flag="tp")
    data_parallel_size: int = _opt(1, "data-parallel engine replicas behind the server", flag="dp")
    nnodes: int = _opt(1, "nodes the tensor-parallel ranks span (each node runs tp / nnodes ranks)")
    node_rank: int = _opt(0, "this node's index: 0 runs the engine, the others only worker ranks")
    dist_init_addr: str | None = _opt(None, "host:port of rank 0's rendezvous (default: a free local port)")
    dist_timeout_s: float = _opt(600.0, "seconds a collective may wait for a rank before failing")

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be positive")
        if self.max_prefill_tokens < self.page_size:
            raise ValueError("max_prefill_tokens must be at least one page")
        if self.mixed_step_tokens is not None and self.mixed_step_tokens < self.page_size:
            raise ValueError("mixed_step_tokens must be at least one page")
        if self.prefill_wait_steps is not None and self.prefill_wait_steps < 0:
            raise ValueError("prefill_wait_steps must be >= 0")
        if self.quantization not in ("auto", "none", "int4"):
            raise ValueError(f"quantization must be auto, none or int4, got {self.quantization!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.load_format == "dummy" and self.tensor_parallel_size > 1:
            raise ValueError("load_format dummy runs on one rank (--tp 1)")
        if self.attention_backend not in ("auto", "sdpa", "triton"):
            raise ValueError(
                f"attention_backend must be auto, sdpa or triton, got {self.attention_backend!r}"
            )
        if self.numerics not in ("auto", "invariant", "fast"):
            raise ValueError(f"numerics must be auto, invariant or fast, got {self.numerics!r}")
        if self.numerics == "invariant" and (
            self.tensor_parallel_size > 1 or self.attention_backend == "sdpa"
        ):
            raise ValueError(
                "numerics invariant needs one rank (--tp 1; an all-reduce sums in an order of its own) "
                "and the Triton attention backend"
            )
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1)")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(
                f"kv_cache_tokens must hold at least one page ({self.page_size}), got {self.kv_cache_tokens}"
            )
        if self.cpu_kv_cache_tokens < self.page_size:
            raise ValueError(f"cpu_kv_cache_tokens must hold at least one page ({self.page_size})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be at least 2 (a prompt token and an output), got {self.max_model_len}"
            )
        if self.grammar_cache_size < 1 or self.grammar_cache_mb < 1:
            raise ValueError("grammar_cache_size and grammar_cache_mb must be positive")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be positive, got {self.cuda_graph_max_bs}")
        self._check_parallel()

    def _check_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tp must be a positive integer, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--dp must be a positive integer, got {self.data_parallel_size}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"need nnodes >= 1 and 0 <= node_rank < nnodes, got {self.nnodes}, {self.node_rank}"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"--tp {self.tensor_parallel_size} does not divide over {self.nnodes} nodes (ranks per node)"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("several nodes need --dist-init-addr host:port (rank 0's node)")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError("--dp with several nodes is not supported: run one server per node group")
        if self.dist_init_addr is not None and self.dist_init_addr.rpartition(":")[2].isdigit() is False:
            raise ValueError(f"--dist-init-addr must be host:port, got {self.dist_init_addr!r}")
        if self.dist_timeout_s <= 0:
            raise ValueError("dist_timeout_s must be positive")
