"""``rl.rollout_engine=vllm``: a vLLM engine colocated on every rank, inside the job's own process group.

Built once per job, on every rank at the same time (``distributed_executor_backend="external_launcher"``:
vLLM reuses the default group; gloo on CPU, NCCL on GPU), in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
in ``rl.rollout_dtype``, from the policy's config with no weights read (``load_format="dummy"``): the first
refresh writes them. It is kept alive to the job's end -- shutting vLLM down destroys the default process
group.

- **Refresh**: ``reload_weights`` in place from a generator over the sharded model's units (one unit gathered
  at a time: what the refresh holds beyond vLLM's own weights), a tied output layer passed as ``lm_head.weight``
  too where vLLM's model has that parameter (Qwen2, GPT-2; Gemma-2's head is its embedding), then the prefix
  cache reset (its blocks were computed with the old weights).
- **KV cache**: ``kv_cache_memory_bytes`` from :func:`~syncwise.memory.rollout.footprint_of` (never
  vLLM's 90%-of-memory default), and what vLLM holds comes off auto's budget like the compact sampler's copy.
- **Prefill** is never chunked on CPU (:func:`batched_tokens`: vLLM's CPU generators cannot rewind a seeded
  request's discarded sample).
- **Sampling**: one request per prompt with ``n = rl.samples_per_prompt`` and its own seed (from the job's
  seed, the step, the rank, the turn and the prompt's index; no two samples of a job share one, and a resumed
  job samples the same responses) -- an agent's requests, each with a seed of its own, one request a sequence
  (:func:`vllm_requests`); every end token as ``stop_token_ids``, ``rl.stop`` as stop strings kept in
  the response. Log-probs: of the distribution sampled from (``processed_logprobs``: the temperature-scaled
  one, the trainer's); with top-k/p or min-p (at temperature 1, the config's check) of the untruncated one
  (``raw_logprobs``).
- **Sleep mode** (CUDA; ``rl.vllm_sleep_level``, :func:`sleep_plan`): after each rollout vLLM sleeps (level 2
  drops its weights and KV cache, level 1 offloads the weights to host memory), and the next refresh wakes
  the weights, reloads them, then wakes the KV cache (the reload's buffers never beside the cache). ``auto``
  sleeps where this rank's training state and its first step's activations do not fit beside vLLM in the
  budget. CPU has no sleep mode.
- **The calling process** keeps its torch RNG state, its thread count and ``torch.set_num_threads``, and
  ``LOCAL_WORLD_SIZE``/``LD_PRELOAD`` (vLLM reseeds, patches and sets them while building).
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ...config.rollout_engines import ROLLOUT_ENGINES
from ...memory.accounting import format_bytes
from ...memory.rollout import VLLM_BLOCK_TOKENS, footprint_of
from ...models import uninitialised_model
from .base import RolloutSetup, Samples, sequence_seeds

# environment variables vLLM sets in the calling process while it builds, restored after
RESTORED_ENV = ("LOCAL_WORLD_SIZE", "LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE")


def check_vllm(hf_config, device_type: str) -> None:
    """Raise ValueError (one line, naming the fix) when vLLM cannot sample this model here: what needs vLLM
    imported (its architectures, ~10 s), beside the table entry's checks."""
    spec = ROLLOUT_ENGINES["vllm"]
    spec.require()
    try:
        from vllm.model_executor.models import ModelRegistry
    except (ImportError, RuntimeError) as exc:  # installed but broken (the CUDA torchvision & co. left in)
        raise ValueError(f"rl.rollout_engine=vllm: vLLM does not import ({exc}); {spec.install}") from None
    archs = list(getattr(hf_config, "architectures", None) or [])
    supported = set(ModelRegistry.get_supported_archs())
    if not archs or not any(a in supported for a in archs):
        raise ValueError(f"rl.rollout_engine=vllm: vLLM has no model for {archs or hf_config.model_type!r}; use "
                         f"rl.rollout_engine=compact")


def sleep_plan(setting: int | str, device_type: str, vllm_bytes: int, training_bytes: int,
               budget: int) -> tuple[int, str]:
    """(sleep level, the words for the first line) for ``rl.vllm_sleep_level=setting``: on CUDA, ``auto``
    is level 2 where the training's ``training_bytes`` and vLLM's ``vllm_bytes`` exceed the rank's ``budget``
    (the refresh rewrites every weight, so nothing need be kept on the host), else 0; CPU has no sleep mode
    (a level there is refused before any rank starts, by the table entry's checks)."""
    if device_type != "cuda":
        return 0, "sleep mode: not on CPU"
    if setting != "auto":
        level = int(setting)
        return level, (f"sleep mode: level {level} during the update (rl.vllm_sleep_level)" if level
                       else "sleep mode: off (rl.vllm_sleep_level=0)")
    over = training_bytes + vllm_bytes > budget
    sizes = (f"training's {format_bytes(training_bytes)} + vLLM's {format_bytes(vllm_bytes)} "
             f"{'>' if over else '<='} budget {format_bytes(budget)}")
    return (2, f"sleep mode: level 2 during the update ({sizes})") if over else (0, f"sleep mode: off ({sizes})")


@contextlib.contextmanager
def process_kept() -> Iterator[None]:
    """What vLLM changes in the calling process while it builds, restored after: torch's RNG state (it
    reseeds), ``torch.set_num_threads`` (its CPU worker replaces it with a no-op) and the thread count, and
    :data:`RESTORED_ENV`."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    env = {key: os.environ.get(key) for key in RESTORED_ENV}
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override the KV size given
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def parameter_names(worker) -> list[str]:
    """The names of vLLM's model's parameters, a tied one under each of its names (run on its worker)."""
    return [name for name, _ in worker.model_runner.model.named_parameters(remove_duplicate=False)]


def batched_tokens(device_type: str, sequences: int, longest: int) -> dict[str, int]:
    """vLLM's token budget per engine step: on CPU every sequence's whole prompt in one step, so no prefill is
    ever chunked -- a chunked prefill discards the sample of its partial step and rewinds the request's seeded
    generator, which a CPU generator cannot do ("CPU Generator does not use offset": a multi-turn job's long
    prompts met it); elsewhere vLLM's default."""
    return {"max_num_batched_tokens": max(4096, sequences * longest)} if device_type == "cpu" else {}


def vllm_requests(seed: int | list[int], prompts: int, n: int) -> list[tuple[int, int, int]]:
    """The call's vLLM requests as (prompt index, samples, seed): vLLM gives a request's k-th sample its seed + k,
    so a prompt whose sequences' seeds run on by one (a call's first seed: prompt i's ``seed + i * n + k``) is one
    request of ``n``; one whose seeds do not (an agent's requests, each its own) a request per sequence."""
    seeds, requests = sequence_seeds(seed, prompts, n), []
    for i in range(prompts):
        own = seeds[i * n:(i + 1) * n]
        if own == list(range(own[0], own[0] + n)):
            requests.append((i, n, own[0]))
        else:
            requests += [(i, 1, one) for one in own]
    return requests


class VllmRollout:
    """One rank's vLLM engine (see the module's docstring)."""

    def __init__(self, setup: RolloutSetup):
        rl, device = setup.rl, setup.device
        hf_config = copy.deepcopy(setup.hf_config)
        shape = uninitialised_model(hf_config, getattr(torch, rl.rollout_dtype), "meta")  # sizes, no memory
        hf_config.architectures = hf_config.architectures or [type(shape).__name__]  # a preset's config has none
        check_vllm(hf_config, device.type)
        ROLLOUT_ENGINES["vllm"].check_model(rl, hf_config, device.type)
        self.rl, self.tokenizer, self.end_ids, self.device = rl, setup.tokenizer, setup.end_ids, device
        self.sequences = rl.sequences_in_flight
        params = sum(p.numel() for p in shape.parameters())
        self.footprint = footprint_of(rl, hf_config, params, setup.max_new_tokens, device.type)
        self.largest_unit_bytes = 0  # the most one refresh held beyond vLLM's weights (one gathered unit)
        self.logprobs_mode = "raw_logprobs" if rl.truncates else "processed_logprobs"
        self.sleep_level, self.sleep_note = sleep_plan(rl.vllm_sleep_level, device.type, self.footprint.sampling,
                                                       setup.training_bytes, setup.memory_budget)
        self.asleep = False
        self._workdir = tempfile.TemporaryDirectory(prefix="syncwise-vllm-")
        self.llm = self._build(hf_config, Path(self._workdir.name), setup.seed)
        # A tied output layer is sent under lm_head's name too where vLLM's model has one of its own (Qwen2,
        # GPT-2: its CPU backend packs the head apart); Gemma-2's ties to the embedding and has none.
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.tied_head = tied and "lm_head.weight" in self.llm.collective_rpc(parameter_names)[0]

    def _build(self, hf_config, workdir: Path, seed: int):
        """The engine, built on every rank at once (the external launcher's groups are made collectively)."""
        hf_config.save_pretrained(workdir)  # the policy's config: vLLM reads no weights (dummy) and no tokenizer
        self.tokenizer.save_pretrained(workdir)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker here: reload_weights reaches it
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # keep the trainer's threads where they are
        import logging

        logging.getLogger("torch._library.triton").setLevel(logging.ERROR)  # vLLM's import warns once per rank
        with process_kept():
            from vllm import LLM

            return LLM(
                model=str(workdir), tokenizer=str(workdir), dtype=self.rl.rollout_dtype, seed=seed,
                load_format="dummy", distributed_executor_backend="external_launcher",
                enforce_eager=self.device.type != "cuda", max_model_len=self.footprint.longest,
                kv_cache_memory_bytes=self.footprint.kv_cache,
                block_size=VLLM_BLOCK_TOKENS.get(self.device.type, 16),
                max_num_seqs=max(self.sequences, 1), enable_prefix_caching=True,
                logprobs_mode=self.logprobs_mode, generation_config="vllm", enable_sleep_mode=self.sleep_level > 0,
                **batched_tokens(self.device.type, max(self.sequences, 1), self.footprint.longest),
            )

    def held_bytes(self) -> int:
        """vLLM's weights, its KV cache, its sampler's working logits and on CPU its runtime, for the whole job
        (none on the device through the update where it sleeps)."""
        return 0 if self.sleep_level else self.footprint.held

    def describe(self) -> str:
        return (f"rollouts by vLLM ({self.rl.rollout_dtype}, KV cache {format_bytes(self.footprint.kv_cache)} for "
                f"sequences up to {self.footprint.longest} tokens; {self.sleep_note})")

    def refresh(self, weights_by_unit: Iterator[dict[str, torch.Tensor]]) -> None:
        if self.asleep:  # the weights' memory back first; the KV cache after the reload's buffers are gone
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._named(weights_by_unit)})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # its blocks hold keys and values of the old weights

    def release(self) -> None:
        """After a rollout: sleep through the update at the planned level (nothing at level 0)."""
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def _named(self, weights_by_unit: Iterator[dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for unit in weights_by_unit:
            self.largest_unit_bytes = max(self.largest_unit_bytes,
                                          sum(t.numel() * t.element_size() for t in unit.values()))
            for name, tensor in unit.items():
                yield name, tensor
                if self.tied_head and name.endswith(("embed_tokens.weight", "transformer.wte.weight")):
                    yield "lm_head.weight", tensor  # vLLM's tied output layer reloads from its own name
            del unit

    def sample(self, prompts: list[list[int]], n: int, max_new_tokens: int, seed: int | list[int]) -> Samples:
        from vllm import SamplingParams

        if self.asleep:  # a rollout runs on refreshed weights (level 2 dropped them)
            raise RuntimeError("the vLLM engine sleeps: refresh its weights before sampling")
        rl = self.rl
        requests = vllm_requests(seed, len(prompts), n)
        params = [SamplingParams(
            n=samples, temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p, min_p=rl.min_p,
            max_tokens=max_new_tokens, stop_token_ids=self.end_ids, stop=rl.stop or None,
            include_stop_str_in_output=True, logprobs=0, seed=request_seed, detokenize=bool(rl.stop),
        ) for _, samples, request_seed in requests]
        outputs = self.llm.generate([{"prompt_token_ids": prompts[i]} for i, _, _ in requests], params,
                                    use_tqdm=False)
        tokens, log_probs, ended = [], [], []
        for request in outputs:
            for completion in sorted(request.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                tokens.append(torch.tensor(ids, dtype=torch.long))
                log_probs.append(torch.tensor([step[t].logprob for step, t in zip(completion.logprobs, ids,
                                                                                   strict=True)]))
                ended.append(completion.finish_reason == "stop")
        drawn = None if self.logprobs_mode == "raw_logprobs" else log_probs
        return Samples(tokens, drawn, computed_rows=sum(len(t) for t in tokens), ended=ended,
                       full_log_probs=log_probs)
