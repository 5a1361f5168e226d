"""vLLM's and SGLang's flag spellings on `umem-jax serve` / `generate`: each one is taken with the
same meaning, or changes nothing and says so in --help (--trust-remote-code); --chat-template
replaces the tokenizer's template for chat requests, a bad one is refused before the model loads."""

from __future__ import annotations

import pytest

from umem_jax import cli

TINY = ["--port", "0", "--arena-bytes", str(2 << 20), "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]


def _parse(*flags):
    return cli.parser().parse_args(["serve", "tiny", *flags])


@pytest.mark.parametrize("flags, dest, value", [
    (["--tp", "2"], "tensor_parallel_size", 2),
    (["--tp-size", "2"], "tensor_parallel_size", 2),
    (["--mem-fraction-static", "0.7"], "gpu_memory_utilization", 0.7),
    (["--max-running-requests", "3"], "max_num_seqs", 3),
    (["--chunked-prefill-size", "512"], "max_num_batched_tokens", 512),
    (["--memory-mode", "static", "--enable-unified-memory"], "memory_mode", "unified"),
    (["--disable-radix-cache"], "enable_prefix_caching", False),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--trust-remote-code"], "trust_remote_code", True),
    (["--enforce-eager"], "enforce_eager", True),
    (["--disable-cuda-graph"], "enforce_eager", True),
    ([], "early_admission", True),  # the engine's default
    (["--no-early-admission"], "early_admission", False),
])
def test_other_servers_spellings_set_the_same_option(flags, dest, value):
    assert getattr(_parse(*flags), dest) == value


def test_enforce_eager_turns_cuda_graphs_off_before_the_backend_starts():
    from umem_jax.engine.flags import NO_CUDA_GRAPHS, apply_enforce_eager

    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    apply_enforce_eager(_parse("--enforce-eager"), env)
    apply_enforce_eager(_parse("--enforce-eager"), env)  # once only
    assert env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {NO_CUDA_GRAPHS}"
    plain = {}
    apply_enforce_eager(_parse(), plain)
    assert plain == {}


def test_model_flag_is_its_own_option_not_an_abbreviation():
    serve = next(a for a in cli.parser()._subparsers._group_actions[0].choices["serve"]._actions
                 if a.dest == "model_path")
    assert "--model" in serve.option_strings
    assert cli.parser().parse_args(["serve", "--model", "tiny"]).model_path == "tiny"


def test_two_different_models_are_refused(capsys):
    assert cli.main(["generate", "tiny", "--model", "tiny-attention", "--prompt", "x"]) == 2
    assert "two models given: 'tiny' and --model-path/--model 'tiny-attention'" in capsys.readouterr().err


def test_help_documents_the_compatibility_flags():
    text = " ".join(cli.parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    for flag in ("--tp", "--mem-fraction-static", "--max-running-requests", "--enable-unified-memory",
                 "--disable-radix-cache", "--trust-remote-code", "--chat-template", "--model MODEL_PATH"):
        assert flag in text, flag
    assert "changes nothing" in text  # --trust-remote-code says it is accepted only


def _serve(monkeypatch, *flags):
    seen = {}
    monkeypatch.setattr("umem_jax.api.server.serve", lambda aeng, names, **kw: seen.update(aeng=aeng) or 0)
    code = cli.main(["serve", "tiny", *TINY, *flags])
    return code, seen.get("aeng")


def test_chat_template_inline_and_from_a_file(monkeypatch, tmp_path):
    conversation = [{"role": "user", "content": "hi"}]
    inline = "{% for m in messages %}<{{ m['role'] }}|{{ m['content'] }}>{% endfor %}"
    code, aeng = _serve(monkeypatch, "--chat-template", inline)
    tok = aeng.engine.tokenizer
    assert code == 0 and tok.decode(tok.encode_chat(conversation)) == "<user|hi>"
    path = tmp_path / "t.jinja"
    path.write_text("[{{ messages[0]['content'] }}]{% if add_generation_prompt %}=>{% endif %}")
    code, aeng = _serve(monkeypatch, "--chat-template", str(path))
    tok = aeng.engine.tokenizer
    assert code == 0 and tok.decode(tok.encode_chat(conversation)) == "[hi]=>"


@pytest.mark.parametrize("given, why", [
    ("no/such/template.jinja", "--chat-template 'no/such/template.jinja': no such file"),
    ("{% for m in messages %}", "--chat-template: the template given, line 1: "),
])
def test_a_bad_chat_template_is_refused_before_loading(monkeypatch, capsys, given, why):
    code, aeng = _serve(monkeypatch, "--chat-template", given)
    err = capsys.readouterr().err
    assert code == 2 and aeng is None and why in err and "loading the weights" not in err, err
