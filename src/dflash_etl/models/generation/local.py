"""Backends that render the chat template here (in the sandbox) and generate with the model in
this process: `transformers` (batched generate with left padding) and offline vLLM
(`LLM.generate`, from the optional extra `gpu`, imported only when chosen)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

from dflash_etl.core.errors import StageError
from dflash_etl.models.generation.replies import THINK_OPEN, Reply, Request
from dflash_etl.models.generation.settings import GenerationSettings, render_kwargs
from dflash_etl.models.identity import model_identity
from dflash_etl.models.loading import placement
from dflash_etl.templates.limits import RenderError


class _LocalTemplate:
    """Backends that render the chat template themselves (in the sandbox) and generate text."""

    settings: GenerationSettings
    tokenizer: Any

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
        from dflash_etl.templates.render import render

        return render(self.tokenizer, messages, chat_template=None, tools=tools,
                      add_generation_prompt=True, kwargs=render_kwargs(self.settings))

    def generate(self, requests: list[Request]) -> list[Reply]:
        """Render each request with the model's template and generate in one batch; a request
        the template refuses gets an error reply with the template's message."""
        prompts, where, replies = [], [], [Reply("", "", 0)] * len(requests)
        for k, (messages, tools) in enumerate(requests):
            try:
                prompts.append(self.render(messages, tools))
                where.append(k)
            except RenderError as exc:
                replies[k] = Reply("", "", 0, error=f"the chat template refused: {exc}")
        for k, prompt, reply in zip(where, prompts, self.generate_text(prompts) if prompts else [],
                                    strict=True):
            replies[k] = dataclasses.replace(reply, think_open=prompt.rstrip().endswith(
                THINK_OPEN))
        return replies

    def generate_text(self, prompts: list[str]) -> list[Reply]:
        raise NotImplementedError


class TransformersBackend(_LocalTemplate):
    """A local causal LM; batched generate with left padding, on GPU when there is one."""

    def __init__(self, settings: GenerationSettings) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch

        from dflash_etl.models.loading import input_device, load_causal_lm, refuse_remote_code
        from dflash_etl.models.tokenizer import load_tokenizer

        self.settings = settings
        self.torch = torch
        self.tokenizer = load_tokenizer(settings.model)
        refuse_remote_code(settings.model)
        placed = placement(settings.device_map, settings.max_memory)
        try:
            self.model = load_causal_lm(settings.model, **placed)
        except Exception as exc:  # transformers raises many types for a bad directory
            raise StageError(f"cannot load a causal LM from {settings.model}: {exc}") from exc
        if placed:  # layers on several devices: ids go in where the embedding is
            self.device = input_device(self.model)
            self.model.eval()
        else:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        if not self.eos_ids:
            raise StageError(f"{settings.model}: neither the generation config nor the tokenizer "
                             "names an end-of-turn (eos) token, so no reply could ever finish")
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids)
        self.model_id = model_identity(settings.model)

    def generate_text(self, prompts: list[str]) -> list[Reply]:
        torch = self.torch
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, e in enumerate(encoded):  # left padding: every prompt ends at the same column
            ids[row, width - len(e):] = torch.tensor(e)
            mask[row, width - len(e):] = 1
        sample = self.settings.temperature > 0
        # seeded by the batch's own prompts: a resumed run samples what an uninterrupted one did
        digest = hashlib.sha256("\x00".join(prompts).encode()).digest()
        torch.manual_seed(self.settings.seed + int.from_bytes(digest[:6], "little"))
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                max_new_tokens=self.settings.max_new_tokens, do_sample=sample,
                temperature=self.settings.temperature if sample else None, top_p=None, top_k=None,
                pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids))
        replies = []
        for row in out[:, width:].tolist():
            end = next((k for k, t in enumerate(row) if t in self.eos_ids), None)
            new = row if end is None else row[:end]
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            replies.append(Reply(text, "length" if end is None else "stop", len(new)))
        return replies


class VLLMBackend(_LocalTemplate):
    """Offline vLLM (`LLM.generate`) from the optional extra `gpu`, imported only when chosen.
    Prompts are rendered here and passed as token ids, exactly as the transformers backend
    tokenizes them (vLLM would otherwise add the tokenizer's BOS to text prompts)."""

    def __init__(self, settings: GenerationSettings) -> None:
        try:
            from vllm import LLM, SamplingParams
        except ImportError as exc:
            raise StageError("--backend vllm needs vLLM, which is not installed: pip install "
                             "'dflash-etl[gpu]' on a CUDA machine, or use --backend transformers "
                             "or --backend openai (e.g. against `vllm serve`)") from exc
        from dflash_etl.models.tokenizer import load_tokenizer

        self.settings = settings
        self.tokenizer = load_tokenizer(settings.model)
        from dflash_etl.models.loading import refuse_remote_code

        refuse_remote_code(settings.model)
        self.llm = LLM(model=settings.model, seed=settings.seed, trust_remote_code=False)
        self.params = SamplingParams(max_tokens=settings.max_new_tokens,
                                     temperature=settings.temperature, seed=settings.seed)
        self.model_id = model_identity(settings.model)
        self.batch_hint = max(settings.batch_size, 256)  # vLLM schedules a large batch itself

    def generate_text(self, prompts: list[str]) -> list[Reply]:
        inputs = [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=False)["input_ids"]}
                  for p in prompts]
        outputs = self.llm.generate(inputs, self.params, use_tqdm=False)
        replies = []
        for out in outputs:
            choice = out.outputs[0]
            replies.append(Reply(choice.text, choice.finish_reason or "stop",
                                 len(choice.token_ids)))
        return replies
