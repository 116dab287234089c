"""`LLM`: the offline API, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tqdm import tqdm

from strata.attention.backend import describe_attention
from strata.config import (
    CacheConfig,
    CompilationConfig,
    ConfigError,
    EngineConfig,
    LayerConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from strata.custom_op import describe_layers
from strata.engine.llm_engine import LLMEngine
from strata.engine.prompts import PromptError, PromptType
from strata.outputs import RequestOutput
from strata.sampling_params import SamplingParams

logger = logging.getLogger("strata")


def default_model() -> str:
    from strata.bundled import default_model as bundled

    return bundled()


def _compilation_config(
    compile: bool | None, config: CompilationConfig | Mapping[str, Any] | None
) -> CompilationConfig:
    """`compile=` wins over the config's own `compile`; a dict is validated field by field."""
    if config is None:
        config = CompilationConfig()
    elif isinstance(config, Mapping):
        fields = set(CompilationConfig.__dataclass_fields__)
        unknown = set(config) - fields
        if unknown:
            raise ConfigError(
                f"compilation_config: unknown keys {sorted(unknown)}; allowed are {', '.join(sorted(fields))}"
            )
        config = CompilationConfig(**config)
    elif not isinstance(config, CompilationConfig):
        raise TypeError(
            f"compilation_config must be a CompilationConfig or a dict, got {type(config).__name__}"
        )
    if compile is not None:
        if not isinstance(compile, bool):
            raise ConfigError(f"compile must be a bool, got {compile!r}")
        config.compile = compile
    return config


def engine_config(
    model: str | None = None,
    *,
    tokenizer: str | None = None,
    dtype: str | torch.dtype = "float32",
    max_model_len: int | None = None,
    seed: int = 0,
    skip_tokenizer_init: bool = False,
    block_size: int = 16,
    kv_cache_memory: int | None = None,
    kv_cache_dtype: str = "auto",
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    device: str = "cpu",
    layer_impl: str | None = None,
    custom_ops: list[str] | None = None,
    prepack_weights: bool | None = None,
    fp32_matmul_precision: str | None = None,
    compile: bool | None = None,
    compilation_config: CompilationConfig | Mapping[str, Any] | None = None,
    quantization: str | None = None,
    gguf_dequantize: bool = False,
    adaptive_threads: bool | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    distributed_timeout: float = 120.0,
) -> EngineConfig:
    """The configuration of an engine with `LLM`'s options (each checked)."""
    model_config = ModelConfig(
        model=model if model is not None else default_model(),
        tokenizer=tokenizer,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        skip_tokenizer_init=skip_tokenizer_init,
        quantization=quantization,
        gguf_dequantize=gguf_dequantize,
    )
    cache_kwargs: dict[str, Any] = {
        "block_size": block_size,
        "enable_prefix_caching": enable_prefix_caching,
        "kv_cache_dtype": kv_cache_dtype,
    }
    if kv_cache_memory is not None:
        cache_kwargs["kv_cache_memory"] = kv_cache_memory
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(**cache_kwargs),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
        ),
        device=device,
        layer_config=LayerConfig(
            layer_impl=layer_impl,
            custom_ops=["all"] if custom_ops is None else custom_ops,
            **({} if prepack_weights is None else {"prepack_weights": prepack_weights}),
            fp32_matmul_precision=fp32_matmul_precision,
        ),
        compilation_config=_compilation_config(compile, compilation_config),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            distributed_timeout=distributed_timeout,
        ),
        adaptive_threads=adaptive_threads,
    )


class LLM:
    """Generate text from prompts with a local Hugging Face model folder (the bundled model by default), on
    the platform `device` names ("cpu", "cuda", "cuda:1", or a plugin's)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """`model`: a model folder or GGUF file (the bundled model by default); `options`: those of
        `engine_config` (dtype, max_model_len, compile, tensor_parallel_size, ...), named as vLLM names them."""
        self.engine = LLMEngine(engine_config(model, **options))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs come back in prompt order."""
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts; give one or one per prompt"
                )
        else:
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
            )
        for params in params_list:
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must hold SamplingParams, got {type(params).__name__}")
        # Validate every prompt before any is queued, so a bad one leaves the engine untouched.
        tokenized = [self.engine.tokenize_prompt(prompt) for prompt in prompt_list]
        request_ids = []
        for (text, ids), params in zip(tokenized, params_list, strict=True):
            prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
            request_ids.append(self.engine.add_request(prompt, params, final_output_only=True).request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[Mapping[str, Any]] | list[list[Mapping[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat template;
        `tools` (OpenAI's function definitions) go to the template, which describes them to the model."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM was created with skip_tokenizer_init=True")
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                "this model's tokenizer has no chat template; pass chat_template=... (a Jinja template string)"
            )
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            {
                "prompt_token_ids": list(
                    tokenizer.apply_chat_template(
                        conversation,
                        chat_template=template,
                        add_generation_prompt=add_generation_prompt,
                        tools=tools,
                        tokenize=True,
                        return_dict=False,
                    )
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def shutdown(self) -> None:
        """Stop the engine's other processes (its ranks); the LLM cannot generate after. Dropping the LLM
        (or leaving its `with` block, or the interpreter exiting) does it too."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> Any:
        """Call `fn` on the underlying `torch.nn.Module` (rank 0's shard, with tensor parallelism) and
        return its result."""
        return self.engine.apply_model(fn)

    def layer_providers(self) -> list[dict[str, str]]:
        """Each replaced layer of the model, then each attention layer: module path, op, provider
        (hw-agnostic, the platform's name or oot:<plugin>), implementation class and the forward in use."""
        runner = self.engine.runner
        names = [spec.name for spec in runner.layers]
        return self.engine.apply_model(describe_layers) + describe_attention(names, runner.attn_backend)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, str | Mapping):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(p, int) for p in prompts):
            return [list(prompts)]  # one prompt given as token ids
        if isinstance(prompts, Sequence):
            if not prompts:
                raise PromptError("prompts is empty")
            return list(prompts)
        raise PromptError(f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            try:
                while len(finished) < len(request_ids):
                    if not self.engine.scheduler.num_unfinished:
                        raise RuntimeError("the engine has no work left but some requests did not finish")
                    for output in self.engine.step():
                        if output.finished and output.request_id in wanted:
                            finished[output.request_id] = output
                            bar.update(1)
            except BaseException:
                for request_id in wanted - finished.keys():
                    self.engine.abort_request(request_id)
                raise
        return [finished[request_id] for request_id in request_ids]
