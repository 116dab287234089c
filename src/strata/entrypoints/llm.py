"""`LLM`: the offline API, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tqdm import tqdm

from strata.attention.backend import describe_attention
from strata.config import CompilationConfig, ConfigError
from strata.custom_op import describe_layers
from strata.engine.llm_engine import LLMEngine
from strata.engine.prompts import PromptError, PromptType
from strata.engine_args import EngineArgs
from strata.outputs import RequestOutput
from strata.sampling_params import SamplingParams

logger = logging.getLogger("strata")


def default_model() -> str:
    from strata.bundled import default_model as bundled

    return bundled()


class LLM:
    """Generate text from prompts with a local Hugging Face model folder (the bundled model by default), on
    the platform `device` names ("cpu", "cuda", "cuda:1", or a plugin's)."""

    def __init__(
        self,
        model: str | None = EngineArgs.model,
        *,
        tokenizer: str | None = EngineArgs.tokenizer,
        dtype: str | torch.dtype = EngineArgs.dtype,
        max_model_len: int | None = EngineArgs.max_model_len,
        seed: int = EngineArgs.seed,
        skip_tokenizer_init: bool = EngineArgs.skip_tokenizer_init,
        quantization: str | None = EngineArgs.quantization,
        gguf_dequantize: bool = EngineArgs.gguf_dequantize,
        device: str = EngineArgs.device,
        adaptive_threads: bool | None = EngineArgs.adaptive_threads,
        block_size: int = EngineArgs.block_size,
        kv_cache_memory: int | None = EngineArgs.kv_cache_memory,
        kv_cache_dtype: str = EngineArgs.kv_cache_dtype,
        enable_prefix_caching: bool = EngineArgs.enable_prefix_caching,
        max_num_seqs: int = EngineArgs.max_num_seqs,
        max_num_batched_tokens: int | None = EngineArgs.max_num_batched_tokens,
        enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill,
        layer_impl: str | None = EngineArgs.layer_impl,
        custom_ops: Sequence[str] = EngineArgs.custom_ops,
        prepack_weights: bool | None = EngineArgs.prepack_weights,
        fp32_matmul_precision: str | None = EngineArgs.fp32_matmul_precision,
        compile: bool | None = EngineArgs.compile,
        compilation_config: CompilationConfig | Mapping[str, Any] | None = EngineArgs.compilation_config,
        tensor_parallel_size: int = EngineArgs.tensor_parallel_size,
        pipeline_parallel_size: int = EngineArgs.pipeline_parallel_size,
        data_parallel_size: int = EngineArgs.data_parallel_size,
        distributed_timeout: float = EngineArgs.distributed_timeout,
        distributed_init_method: str | None = EngineArgs.distributed_init_method,
    ) -> None:
        """Build the engine. The arguments are `EngineArgs`' fields, named as vLLM names them, with the
        defaults shown in the signature:

        Args:
            model: a local Hugging Face model folder or .gguf file (default: the bundled stories260K)
            tokenizer: a tokenizer folder (default: the model's)
            dtype: what the model computes in: float32, bfloat16, float16 or auto (the checkpoint's)
            max_model_len: context length in tokens (default: the model's)
            seed: the engine's sampling seed, for requests that give none
            skip_tokenizer_init: load no tokenizer: prompts are token ids, outputs have no text
            quantization: int8: weight-only int8 Linear layers, quantized per channel at load (default: off,
                or what the model folder was stored as)
            gguf_dequantize: dequantize GGUF tensors of types Strata does not compute on (IQ*, TQ*) at load,
                with a warning, instead of refusing the file
            device: the platform to run on: cpu, cuda, cuda:N, or a plugin's platform
            adaptive_threads: let the CPU thread count follow measured step times (default:
                STRATA_ADAPTIVE_THREADS, on)
            block_size: tokens per KV-cache block
            kv_cache_memory: bytes for the KV cache (default: STRATA_KV_CACHE_MEMORY, else max_num_seqs
                full-length sequences, at most a quarter of free memory)
            kv_cache_dtype: dtype the KV cache stores keys and values in; auto: the model's dtype
            enable_prefix_caching: reuse the KV cache of prompt prefixes computed before
            max_num_seqs: most sequences in one batch
            max_num_batched_tokens: most tokens in one step (default: 2048, or a whole prompt when chunked
                prefill is off)
            enable_chunked_prefill: let a long prompt take several steps
            layer_impl: layer implementations: default, or hw-agnostic (every op's pure-PyTorch reference)
                (default: hw-agnostic when STRATA_USE_HW_AGNOSTIC=1, else default)
            custom_ops: which ops use their platform's implementation: 'all' or 'none', then '+op' or '-op'
                entries; comma-separated on the command line, e.g. 'all,-silu_and_mul' or 'none,+rms_norm'
            prepack_weights: replace float32 CPU linear weights by Strata's GEMM panels after loading
                (AVX-512 builds), read at every batch size; each weight is still held once (default:
                STRATA_PREPACK_WEIGHTS, on)
            fp32_matmul_precision: torch.set_float32_matmul_precision for packing float32 weights: 'high'
                multiplies them as bf16x3 on CPUs with AMX, at every row count (default: torch's own
                setting, 'highest' unless changed)
            compile: torch.compile the model forward, piecewise (default: STRATA_COMPILE, off)
            compilation_config: how the forward is compiled: a CompilationConfig or a dict of its fields
                (compile, when given, wins over its own)
            tensor_parallel_size: processes the model is sharded over, each with its share of the cores
            pipeline_parallel_size: pipeline stages the decoder layers are split over, a process each
            data_parallel_size: engine replicas behind the server, each a process with its share of the
                cores; a request goes to the replica with the fewest unfinished requests (an LLM is one
                engine: only 1; `strata serve --data-parallel-size` runs replicas)
            distributed_timeout: seconds a collective may wait for a rank before the engine fails naming it
            distributed_init_method: where the ranks meet, a torch.distributed init method such as
                tcp://HOST:PORT (default: a free local port)
        """
        # The arguments, and nothing else yet, are this frame's locals: EngineArgs' fields, one for one.
        options = dict(locals())
        del options["self"]
        if data_parallel_size != 1:
            raise ConfigError(
                f"data_parallel_size={data_parallel_size}: an LLM is one engine; replicas run behind "
                "`strata serve --data-parallel-size`"
            )
        self.engine = LLMEngine(EngineArgs(**options).create_engine_config())

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
