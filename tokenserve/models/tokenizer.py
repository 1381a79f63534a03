"""Text <-> token ids and chat templates for a Hugging Face-format model directory.

Wraps ``tokenizers.Tokenizer`` (``tokenizer.json``) with the few settings transformers reads from
``tokenizer_config.json`` (special tokens, ``add_bos_token``, ``chat_template``) and
``generation_config.json`` (extra EOS ids). Chat templates render the way transformers'
``apply_chat_template`` renders them (``utils/chat_template_utils.py``): a sandboxed Jinja2
environment with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a
non-HTML-escaping ``tojson`` filter and the ``raise_exception``/``strftime_now`` globals.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """The tokenizer of one model directory.

    Args:
        model_dir: directory holding ``tokenizer.json`` and optionally
            ``tokenizer_config.json``, ``generation_config.json``, ``chat_template.jinja``.

    Raises:
        FileNotFoundError: no ``tokenizer.json``.
    """

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found")
        self._tk = _HFTokenizer.from_file(str(path))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")

        self._special: dict[str, str | None] = {
            name: _token_content(cfg.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self._bos_id = self._token_id(self._special["bos_token"])
        eos: list[int] = []
        if (eos_id := self._token_id(self._special["eos_token"])) is not None:
            eos.append(eos_id)
        gen_eos = gen.get("eos_token_id")
        eos.extend([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self._eos_ids = tuple(dict.fromkeys(int(e) for e in eos))

        # tokenizer.json's post-processor is the source of truth for added BOS (as in
        # transformers' fast tokenizers); add_bos_token only adds one where it adds none.
        post = self._tk.post_processor
        adds_nothing = post is None or post.num_special_tokens_to_add(False) == 0
        self._prepend_bos = bool(cfg.get("add_bos_token")) and adds_nothing
        if self._prepend_bos and self._bos_id is None:
            raise ValueError("add_bos_token is set but bos_token is not in the vocabulary")

        jinja_file = model_dir / "chat_template.jinja"
        template = cfg.get("chat_template")
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        elif isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        self._chat_template: str | None = template or None

    # ------------------------------------------------------------------ ids <-> text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        Special-token strings in ``text`` (``<|im_start|>``...) map to their single ids.
        With ``add_special_tokens``, the post-processor's tokens are added, and BOS is
        prepended when ``add_bos_token`` asks for it and the post-processor adds none.
        Encode a rendered chat template with ``add_special_tokens=False``.
        """
        ids = self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            assert self._bos_id is not None
            ids.insert(0, self._bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes of an incomplete UTF-8 character decode to U+FFFD."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """Vocabulary strings of ``ids`` (byte-level spelling, e.g. ``Ġthe``); None if unknown."""
        return [self._tk.id_to_token(i) for i in ids]

    def to_json_str(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (``tokenizers.Tokenizer.to_str``), for
        libraries that build their own view of it (llguidance, structured output)."""
        return self._tk.to_str()

    # ------------------------------------------------------------------ vocabulary facts

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of ``bos_token`` from tokenizer_config.json, or None."""
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token`` then generation_config.json's ``eos_token_id``(s), de-duplicated."""
        return self._eos_ids

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of every added token marked special: what ``skip_special_tokens`` drops."""
        return sorted(i for i, t in self._tk.get_added_tokens_decoder().items() if t.special)

    @property
    def chat_template(self) -> str | None:
        """The Jinja template: ``chat_template.jinja``, else tokenizer_config.json's, else None."""
        return self._chat_template

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) into a prompt string.

        Template variables: ``messages``, ``add_generation_prompt``, ``bos_token``,
        ``eos_token``, ``unk_token``, ``pad_token`` and ``kwargs`` (e.g. ``tools``).

        Raises:
            ValueError: no chat template; malformed messages; the template raised
                (``raise_exception``) or failed to render.
        """
        if self._chat_template is None:
            raise ValueError("this model has no chat template")
        if isinstance(messages, (str, bytes)) or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages
        ):
            raise ValueError("messages must be a list of mappings with a string 'role'")
        variables = {k: v for k, v in self._special.items() if v is not None}
        variables.update(kwargs)
        try:
            return self._compiled_template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        assert self._chat_template is not None
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self._chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not compile: {e}") from e

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tk.token_to_id(token)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates want plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
