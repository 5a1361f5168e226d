"""Tokenizers: text <-> token ids, and chat templates.

    tok = get_tokenizer(model)              # HFTokenizer (tokenizer.json) or ByteTokenizer (tiny)
    ids = tok.encode("Hello")               # special tokens (BOS) as the tokenizer's post-processor adds them
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])

`HFTokenizer` wraps the `tokenizers` library (no transformers needed) plus tokenizer_config.json
(special tokens, chat_template) and generation_config.json (extra EOS ids, e.g. Gemma's
<end_of_turn>).  `ByteTokenizer` is the built-in tokenizer of the tiny random model: one id
per byte above its special ids, so any string round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path

# Used when a checkpoint ships no chat template (a GGUF conversion, for one): Gemma's turn format as
# its own template writes it -- a system message opens the first user turn (there is no system
# turn), the turns alternate user / assistant starting with user, anything else is refused.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] ~ '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('turns must alternate user / assistant, starting with user (after one system message), "
    "got ' ~ m['role'] ~ ' at turn ' ~ loop.index0) }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict | None = None, **special) -> str:
    """Render a Jinja chat template the way transformers does (sandboxed, trim_blocks).
    continue_final_message: the text ends with the last message's content, as if the model had
    written it so far (what the template writes after it, an end of turn, is cut), so the
    model continues that message instead of starting a new one.  template_kwargs: more of the
    template's variables (a request's chat_template_kwargs: Qwen's enable_thinking, ...);
    `special` (the tokenizer's bos_token, eos_token) comes after them."""
    taken = sorted({"messages", "add_generation_prompt"} & set(template_kwargs or {}))
    if taken:
        raise ValueError(f"chat_template_kwargs: {', '.join(taken)} is set by the request's own fields")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be true with add_generation_prompt (a new turn cannot "
                         "follow a message that is being continued)")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ValueError(f"chat template: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
    text = env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **{**(template_kwargs or {}), **special})
    if not continue_final_message:
        return text
    last = str(messages[-1]["content"]).strip() if messages else ""
    at = text.rfind(last) if last else -1
    if at < 0:
        raise ValueError("continue_final_message: the last message's content does not appear in the rendered "
                         "chat (this chat template changes it), so there is no end to continue from")
    return text[:at + len(last)]


def read_chat_template(given: str | None) -> str | None:
    """--chat-template: a file's text, or the Jinja template itself (as vLLM takes it: a string
    with template syntax is the template); checked to parse.  None: the tokenizer's own."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if given is None:
        return None
    path = Path(given).expanduser()
    if path.is_file():
        template, where = path.read_text(encoding="utf-8"), str(path)
    elif any(c in given for c in "{}\n"):
        template, where = given, "the template given"
    else:
        raise ValueError(f"--chat-template {given!r}: no such file (and not a Jinja template)")
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: {where}, line {e.lineno}: {e.message}") from None
    return template


class ByteTokenizer:
    """Bytes as tokens: id = offset + byte, offset = one past the special ids (tiny model)."""

    def __init__(self, vocab_size: int, bos_token_id: int | None = 1, eos_token_id: int | None = 2,
                 pad_token_id: int | None = 0):
        specials = [t for t in (bos_token_id, eos_token_id, pad_token_id) if t is not None]
        self.offset = max(specials, default=-1) + 1
        if vocab_size < self.offset + 256:
            raise ValueError(f"a byte tokenizer needs {self.offset + 256} ids, the vocabulary has {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id, self.pad_token_id = bos_token_id, pad_token_id
        self.eos_token_ids = () if eos_token_id is None else (eos_token_id,)
        self._names = {bos_token_id: "<bos>", eos_token_id: "<eos>", pad_token_id: "<pad>"}
        self.chat_template = PLAIN_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.offset + b for b in text.encode("utf-8")]
        return ([self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out, raw = [], bytearray()
        for t in ids:
            t = int(t)
            if self.offset <= t < self.offset + 256:
                raw.append(t - self.offset)
                continue
            if not skip_special_tokens:
                out.append(raw.decode("utf-8", errors="replace"))
                raw = bytearray()
                out.append(self._names.get(t, f"<extra_{t}>"))
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        return self.encode(render_chat(self.chat_template, messages, add_generation_prompt, continue_final_message,
                                       template_kwargs))


class HFTokenizer:
    """A Hugging Face tokenizer.json (+ tokenizer_config.json / generation_config.json)."""

    def __init__(self, path: str | Path, extra_eos_ids: tuple[int, ...] = (), bos_token_id: int | None = None):
        """extra_eos_ids / bos_token_id: the model config's, used when tokenizer_config.json is
        missing or silent (a GGUF conversion may ship tokenizer.json alone)."""
        from tokenizers import Tokenizer

        path = Path(path)
        file = path if path.is_file() else path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tok = Tokenizer.from_file(str(file))
        d = file.parent
        cfg = _read_json(d / "tokenizer_config.json")
        self.vocab_size = self.tok.get_vocab_size()
        name = lambda i: self.tok.id_to_token(i) if i is not None else None
        self.bos_token = _content(cfg.get("bos_token")) or name(bos_token_id)
        self.eos_token = _content(cfg.get("eos_token")) or name(extra_eos_ids[0] if extra_eos_ids else None)
        self.bos_token_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = [self.tok.token_to_id(self.eos_token) if self.eos_token else None, *extra_eos_ids]
        gen = _read_json(d / "generation_config.json").get("eos_token_id")
        eos += gen if isinstance(gen, list) else [gen]
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if template is None and (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        if template is None:
            turn_end = self.tok.token_to_id("<end_of_turn>")
            if self.tok.token_to_id("<start_of_turn>") is not None and turn_end is not None:
                template = GEMMA_TEMPLATE
                eos.append(turn_end)  # our template ends turns there, so the model will too
            else:
                template = PLAIN_TEMPLATE
        self.chat_template = template
        self.eos_token_ids = tuple(dict.fromkeys(e for e in eos if e is not None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a long text tokenized in the server's
        # pool must not stall the engine thread
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        text = render_chat(self.chat_template, messages, add_generation_prompt, continue_final_message,
                           template_kwargs, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        return self.encode(text, add_special_tokens=False)  # the template already wrote BOS


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}


def _content(t):
    return t["content"] if isinstance(t, dict) else t


def get_tokenizer(model, path: str | Path | None = None):
    """The tokenizer for a loaded Model: `path` if given, else its tokenizer.json, else the
    byte tokenizer for the built-in tiny model; None when there is none (token ids only)."""
    cfg = model.config
    eos = cfg.eos_token_id
    eos = tuple(eos) if isinstance(eos, (tuple, list)) else (() if eos is None else (eos,))
    if path is not None:
        return HFTokenizer(path, eos, cfg.bos_token_id)
    if getattr(model, "tokenizer_path", None) is not None and Path(model.tokenizer_path).exists():
        return HFTokenizer(model.tokenizer_path, eos, cfg.bos_token_id)
    if cfg.architecture == "UmemTinyHybrid":
        return ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, eos[0] if eos else None, cfg.pad_token_id)
    return None


__all__ = ["ByteTokenizer", "HFTokenizer", "get_tokenizer", "read_chat_template", "render_chat"]
