"""Gemma's tokenizer from a GGUF's metadata, with the `tokenizers` library alone (no torch, no
transformers).

A Gemma GGUF stores a SentencePiece BPE vocabulary: `tokenizer.ggml.tokens` in merge-priority
order (the file order, not the scores, is the merge rank), a token type per entry (3 control,
4 user-defined, 6 byte) and no merge list.  The equivalent `tokenizers` BPE model:

  * vocab: the tokens by id, with tokens made only of spaces respelled as "▁" runs (the
    normaliser turns every space into "▁" before the model sees the text);
  * merges: every split (left, right) of a token whose two halves are both tokens, ordered by
    the merged token's rank, then by longer left half first;
  * byte fallback for anything else; control tokens become special added tokens, user-defined
    ones (e.g. "\\n\\n") plain added tokens, both matched whole on the raw text;
  * `<bos>` prepended when the file says add_bos_token.

tests/models/test_models_gemma3_270m.py checks the result id for id against transformers' converter.
"""

from __future__ import annotations

from pathlib import Path

CONTROL, USER_DEFINED = 3, 4


def gemma_tokenizer(tokens: list[str], token_types: list[int], *, bos_id: int | None, unk_id: int,
                    add_bos: bool = True):
    """Build a `tokenizers.Tokenizer` from a Gemma SentencePiece vocabulary (GGUF metadata)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}  # a respelled duplicate keeps its last id
    merges = []
    for t in sorted(vocab, key=vocab.get):  # rank order = file order
        merges.extend((t[:k], t[k:]) for k in range(len(t) - 1, 0, -1) if t[:k] in vocab and t[k:] in vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=spelled[unk_id], fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, token_types) if kind == CONTROL])
    # A user-defined token made of spaces was respelled above; as raw text it is not in the vocab.
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, token_types) if kind == USER_DEFINED and t in vocab])
    if add_bos and bos_id is not None:
        bos = spelled[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                                           special_tokens=[(bos, bos_id)])
    return tok


def gguf_tokenizer(reader):
    """The tokenizer a Gemma GGUF describes (reader: gguf_file.GGUFFile or gguf.GGUFReader)."""
    f = reader.fields
    model = f["tokenizer.ggml.model"].contents() if "tokenizer.ggml.model" in f else None
    arch = f["general.architecture"].contents()
    if model != "llama" or not str(arch).startswith("gemma"):
        raise NotImplementedError(
            f"tokenizer {model!r} of a {arch!r} GGUF: only Gemma's SentencePiece BPE is built here")
    get = lambda k, d=None: f[k].contents() if k in f else d
    return gemma_tokenizer(list(get("tokenizer.ggml.tokens")), list(get("tokenizer.ggml.token_type")),
                           bos_id=get("tokenizer.ggml.bos_token_id"), unk_id=get("tokenizer.ggml.unknown_token_id", 3),
                           add_bos=bool(get("tokenizer.ggml.add_bos_token", True)))


def write_gguf_tokenizer(reader, out_dir: str | Path) -> Path:
    path = Path(out_dir) / "tokenizer.json"
    gguf_tokenizer(reader).save(str(path))
    return path
