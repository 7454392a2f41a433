"""Typed configuration of one real SGLang server and the `python -m sglang.launch_server` command it becomes.

Flag names were checked against sgl-project/sglang python/sglang/srt/server_args.py (0.5.x and the newer
dataclass-driven version): `--tp-size`/`--dp-size` (the long spellings every release accepts), the DSA
backends `--nsa-prefill-backend`/`--nsa-decode-backend` (older) renamed `--dsa-*` (newer, `nsa` kept as a
deprecated alias; attention backend `nsa` -> `dsa` likewise). `dsa_flag_style` picks the spelling.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
DSA_BACKENDS = ("flashmla_sparse", "flashmla_sparse_q8", "flashmla_kv", "flashmla_auto", "flashinfer_sparse_mla",
                "fa3", "tilelang", "aiter", "trtllm")
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")


@dataclass
class SpeculativeConfig:
    """EAGLE / MTP speculative decoding (GLM-5 ships an MTP layer, which SGLang drives as EAGLE)."""

    algorithm: str = "EAGLE"
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4
    draft_model_path: str | None = None  # None: the target model's own MTP layers

    def validate(self) -> None:
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative.algorithm {self.algorithm!r} is not one of {SPECULATIVE_ALGORITHMS}")
        for name in ("num_steps", "eagle_topk", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"speculative.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class SGLangConfig:
    """One SGLang server for a DSA model (GLM-5, DeepSeek-V3.2). Every field maps to one launch flag."""

    model_path: str
    tokenizer_path: str | None = None
    """--tokenizer-path; None: the model's own"""
    host: str = "127.0.0.1"
    port: int = 30000
    tp: int = 1
    """tensor parallel size (--tp-size)"""
    dp: int = 1
    """data parallel size (--dp-size); with enable_dp_attention, attention runs DP inside the TP group"""
    enable_dp_attention: bool = False
    mem_fraction_static: float | None = 0.85
    kv_cache_dtype: str = "auto"
    page_size: int | None = None  # DSA forces 64 on CUDA; leave None to let SGLang decide
    attention_backend: str | None = None  # "nsa"/"dsa" for DSA models; None: SGLang's choice
    dsa_prefill_backend: str | None = None
    dsa_decode_backend: str | None = None
    dsa_flag_style: str = "nsa"
    """"nsa": --nsa-*-backend and attention backend "nsa" (0.5.x); "dsa": the renamed flags of newer releases"""
    speculative: SpeculativeConfig | None = None
    tool_call_parser: str | None = "glm47"
    reasoning_parser: str | None = "glm45"
    enable_memory_saver: bool = False
    enable_return_indexer_topk: bool = False
    """answer return_indexer_topk (index replay); needs a release that has --enable-return-indexer-topk"""
    max_running_requests: int | None = None
    context_length: int | None = None
    chunked_prefill_size: int | None = None
    trust_remote_code: bool = False
    served_model_name: str | None = None
    api_key: str | None = None
    log_level: str | None = None
    extra_args: list[str] = field(default_factory=list)
    """appended verbatim, after every typed flag"""
    python: str = sys.executable

    def validate(self) -> "SGLangConfig":
        """Raise ValueError naming the offending field."""
        if not self.model_path:
            raise ValueError("model_path is required")
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp ({self.tp}) and dp ({self.dp}) must be >= 1")
        if self.enable_dp_attention and self.tp % self.dp:
            raise ValueError(f"tp ({self.tp}) must be divisible by dp ({self.dp}) with enable_dp_attention")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        if self.dsa_flag_style not in ("nsa", "dsa"):
            raise ValueError(f"dsa_flag_style must be 'nsa' or 'dsa', got {self.dsa_flag_style!r}")
        for name in ("dsa_prefill_backend", "dsa_decode_backend"):
            value = getattr(self, name)
            if value is not None and value not in DSA_BACKENDS:
                raise ValueError(f"{name} {value!r} is not one of {DSA_BACKENDS}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.speculative is not None:
            self.speculative.validate()
        return self

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


def _attention_backend(name: str, style: str) -> str:
    if name in ("nsa", "dsa"):
        return style
    return name


def build_command(config: SGLangConfig) -> list[str]:
    """The argv of `python -m sglang.launch_server` for `config` (validated first)."""
    c = config.validate()
    cmd = [c.python, "-m", "sglang.launch_server", "--model-path", c.model_path, "--host", c.host,
           "--port", str(c.port), "--tp-size", str(c.tp)]
    if c.dp > 1:
        cmd += ["--dp-size", str(c.dp)]
    if c.enable_dp_attention:
        cmd.append("--enable-dp-attention")
    if c.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(c.mem_fraction_static)]
    if c.kv_cache_dtype != "auto":
        cmd += ["--kv-cache-dtype", c.kv_cache_dtype]
    if c.page_size is not None:
        cmd += ["--page-size", str(c.page_size)]
    if c.attention_backend is not None:
        cmd += ["--attention-backend", _attention_backend(c.attention_backend, c.dsa_flag_style)]
    if c.dsa_prefill_backend is not None:
        cmd += [f"--{c.dsa_flag_style}-prefill-backend", c.dsa_prefill_backend]
    if c.dsa_decode_backend is not None:
        cmd += [f"--{c.dsa_flag_style}-decode-backend", c.dsa_decode_backend]
    if c.speculative is not None:
        s = c.speculative
        cmd += ["--speculative-algorithm", s.algorithm, "--speculative-num-steps", str(s.num_steps),
                "--speculative-eagle-topk", str(s.eagle_topk), "--speculative-num-draft-tokens", str(s.num_draft_tokens)]
        if s.draft_model_path:
            cmd += ["--speculative-draft-model-path", s.draft_model_path]
    if c.tool_call_parser:
        cmd += ["--tool-call-parser", c.tool_call_parser]
    if c.reasoning_parser:
        cmd += ["--reasoning-parser", c.reasoning_parser]
    if c.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if c.enable_return_indexer_topk:
        cmd.append("--enable-return-indexer-topk")
    for flag, value in (("--tokenizer-path", c.tokenizer_path), ("--max-running-requests", c.max_running_requests),
                        ("--context-length", c.context_length),
                        ("--chunked-prefill-size", c.chunked_prefill_size), ("--served-model-name", c.served_model_name),
                        ("--api-key", c.api_key), ("--log-level", c.log_level)):
        if value is not None:
            cmd += [flag, str(value)]
    if c.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd + list(c.extra_args)
