"""A pretrained checkpoint's tokenizer (Hugging Face ``tokenizers``), as the data layer
keeps it: a run started from a checkpoint saves it with its own tokenizer files.
``qkv.models.load_tokenizer`` reads one from a checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterable

from .errors import DataError


class PretrainedTokenizer:
    """A checkpoint's tokenizer: ``encode``, ``decode``, ``token_strings`` and, for chat
    models, ``apply_chat_template``.

    ``encode(text)`` adds the special tokens the checkpoint's own tokenizer adds by default
    (BERT's [CLS] ... [SEP], a BOS where the checkpoint asks for one)."""

    kind = "pretrained"

    def __init__(self, tokenizer, *, bos: str | None = None, eos: str | None = None,
                 pad: str | None = None, add_bos: bool = False, chat_template: str | None = None):
        self.tokenizer = tokenizer
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.bos_id, self.eos_id, self.pad_id = (self._id(t) for t in (bos, eos, pad))
        self.bos, self.eos, self.pad = bos, eos, pad
        self.add_bos, self.chat_template = add_bos, chat_template
        self.max_length: int | None = None  # the checkpoint's own input limit, when it has one
        unk = getattr(tokenizer.model, "unk_token", None)
        # What an empty prompt starts from (qkv's lm task): the unknown token, else BOS/EOS.
        self.unk_id = next((i for i in (self._id(unk), self.bos_id, self.eos_id)
                            if i is not None), 0)
        self.special_ids = {
            i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True,
               max_length: int | None = None) -> list[int]:
        """text -> ids; ``max_length`` truncates (keeping the special tokens it adds)."""
        if max_length is not None:
            self.tokenizer.enable_truncation(max_length)
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self.tokenizer.no_truncation()
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary's own spelling of each id ('Ġthe', '##ing', '<|im_start|>')."""
        return [self.tokenizer.id_to_token(int(i)) or f"<{int(i)}>" for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages [{"role": ..., "content": ...}, ...] -> the prompt text the model expects."""
        if not self.chat_template:
            raise DataError("this tokenizer has no chat template (not a chat model)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos or "", eos_token=self.eos or "")

    def to_json(self) -> dict:
        return {"kind": self.kind, "tokenizer": json.loads(self.tokenizer.to_str()),
                "bos": self.bos, "eos": self.eos, "pad": self.pad, "add_bos": self.add_bos,
                "chat_template": self.chat_template}

    @classmethod
    def from_json(cls, data: dict) -> PretrainedTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(json.dumps(data["tokenizer"])), bos=data.get("bos"),
                   eos=data.get("eos"), pad=data.get("pad"), add_bos=data.get("add_bos", False),
                   chat_template=data.get("chat_template"))
