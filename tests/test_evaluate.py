"""`dflash-etl eval`: the embedded default's drafter measured on the real benchmark files
(../shared/fixtures/evalsets), with the same simulator as train's tau: exact at its ends (a
proposer that is always right gives the block size per step, one that is always wrong gives 1),
MT-Bench's second turn after the target's own first reply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_etl.core.errors import StageError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # the session's default run (its trained drafter)

REPO = Path(__file__).resolve().parents[1]
EVALSETS = REPO.parent / "shared" / "fixtures" / "evalsets"
BENCHES = [str(EVALSETS / n) for n in ("mt_bench_question.jsonl", "gsm8k_test.jsonl",
                                       "humaneval.jsonl")]


@pytest.fixture(scope="module")
def run(default_run_dir) -> Path:
    if not (EVALSETS / "gsm8k_test.jsonl").is_file():
        pytest.skip(f"{EVALSETS} is absent (the benchmark prompt sets, ../shared/fixtures)")
    return default_run_dir


def test_tau_per_benchmark_with_the_untrained_baseline(run, tmp_path, monkeypatch):
    from dflash_etl import evaluate

    seen: list[list[dict]] = []
    real = evaluate.Evaluator.prompt_ids

    def recording(self, messages):
        seen.append([dict(m) for m in messages])
        return real(self, messages)

    monkeypatch.setattr(evaluate.Evaluator, "prompt_ids", recording)
    results = evaluate.evaluate(BENCHES, run=run, out=tmp_path, limit=2,
                                decoding=evaluate.Decoding(16),
                                baseline=True)
    assert set(results) == {"mt_bench_question", "gsm8k_test", "humaneval"}
    block = json.loads((run / "train" / "drafter" / "config.json").read_text())["block_size"]
    for name, doc in results.items():
        saved = json.loads((tmp_path / f"{name}.json").read_text())
        assert saved["tau"] == doc["tau"] and 1.0 <= doc["tau"] <= block
        assert doc["prompts"] == 2 and doc["baseline"] >= 1.0
        steps = {int(k): v for k, v in doc["accepted_per_step"].items()}
        assert sum(steps.values()) == doc["verify_steps"]
        assert sum(k * v for k, v in steps.items()) == doc["tokens"]
        assert doc["target"]["identity"] and doc["settings"]["temperature"] == 0.0
    mt = results["mt_bench_question"]
    assert [p["turns"] for p in mt["per_prompt"]] == [2, 2]
    # z-lab's benchmark averages per turn (each turn a request of its own); per item beside it
    turn_taus = [t for p in mt["per_prompt"] for t in p["turn_taus"] if t is not None]
    assert mt["turns"] == 4 and mt["turns_with_a_step"] == len(turn_taus)
    assert mt["tau"] == pytest.approx(sum(turn_taus) / len(turn_taus), abs=1e-4)
    items = [p["tau"] for p in mt["per_prompt"] if p["tau"] is not None]
    assert mt["tau_per_item"] == pytest.approx(sum(items) / len(items), abs=1e-4)
    gsm8k = results["gsm8k_test"]
    assert gsm8k["tau"] == gsm8k["tau_per_item"] and gsm8k["turns"] == 2
    line = "; ".join(evaluate._summary_parts(mt))
    assert f"tau {mt['tau']:.3f} (untrained {mt['baseline']:.3f}) (mean over " in line
    assert f"as z-lab's benchmark, per item (turns pooled) {mt['tau_per_item']:.3f})" in line
    assert f"{mt['tokens_per_step']:.3f} tokens per step" in line
    assert "per item" not in "; ".join(evaluate._summary_parts(gsm8k))  # one turn: one figure
    assert set(mt["tau_by_category"]) <= {"writing", "roleplay", "reasoning", "math", "coding",
                                         "extraction", "stem", "humanities"}
    # the second turn's prompt holds the target's own first reply, then the second question
    second = [m for m in seen if len(m) == 3]
    assert second and all(m[1]["role"] == "assistant" and m[1]["content"] for m in second)
    # the thinking mode the run's rows were rendered in (the default's template has none)
    assert mt["settings"]["template_kwargs"] == {}
    # the report's section: the table and a histogram per benchmark
    from dflash_etl.report.pages import evaluation_section

    (tmp_path / "eval").mkdir()
    for name in results:
        (tmp_path / "eval" / f"{name}.json").write_text((tmp_path / f"{name}.json").read_text())
    html = evaluation_section(tmp_path)
    assert "Acceptance per benchmark" in html and html.count("<svg") == 3
    assert all(f"<td>{name}</td>" in html for name in results)


def _oracle(target):
    """Drafts the target's own greedy tokens: every draft is accepted."""
    def propose(context, seq, room):
        drafts, text = [], list(seq)
        for _ in range(min(15, room)):
            logits, _ = target.forward([text], logits=True, logits_keep=1)
            drafts.append(int(logits[0][-1].argmax()))
            text.append(drafts[-1])
        return drafts
    return propose


def test_the_simulator_is_exact_at_both_ends(run, tmp_path):
    from dflash_etl import evaluate
    from dflash_etl.io.benchmarks import read_benchmark

    evaluator = evaluate.Evaluator(run / "train" / "drafter",
                                   str(run / "target"), {}, evaluate.Decoding(40))
    item = read_benchmark(EVALSETS / "gsm8k_test.jsonl")[0]
    oracle, vocab = _oracle(evaluator.target), evaluator.target.model.config.vocab_size
    # never the target's token: its own greedy one, plus one
    evaluator.propose = lambda context, seq, room: [(t + 1) % vocab
                                                    for t in oracle(context, seq, room)]
    wrong = evaluator.item(item)
    assert wrong["tau"] == 1.0 and set(wrong["accepted"]) == {1}
    evaluator.propose = oracle
    right = evaluator.item(item)
    # every step adds the whole block (16), but the last: the room left or the end of turn
    assert set(right["accepted"][:-1]) == {16}, right["accepted"]
    assert sum(right["accepted"]) == sum(wrong["accepted"])  # the same greedy text


def test_errors_say_what_to_give(run, tmp_path):
    from dflash_etl import evaluate

    with pytest.raises(StageError, match="has no complete train stage"):
        evaluate.evaluate(BENCHES[:1], run=tmp_path)
    with pytest.raises(StageError, match="give --run R, or --drafter DIR and --target DIR"):
        evaluate.evaluate(BENCHES[:1], out=tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a question"}) + "\n")
    with pytest.raises(StageError, match=r"bad.jsonl:1: no benchmark layout in keys \['text'\]"):
        evaluate.evaluate([str(bad)], run=run, out=tmp_path)


def test_the_run_target_is_found_from_another_working_directory(tmp_path, monkeypatch):
    """train records the target as the run was started (a relative path from that directory);
    eval from elsewhere, or on a moved run, uses the run's own built target."""
    from dflash_etl.evaluate import _run_target

    run_dir = tmp_path / "moved" / "run"
    (run_dir / "target").mkdir(parents=True)
    (run_dir / "target" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert _run_target(run_dir, {"target": "runs/default/target"}) == str(run_dir / "target")
    (run_dir / "target" / "config.json").unlink()
    with pytest.raises(StageError, match="runs/default/target is not there any more"):
        _run_target(run_dir, {"target": "runs/default/target"})


def test_served_tau_is_the_servers_own_count_and_equals_the_simulators(run, tmp_path):
    """eval --server against the dev server serving the run's target with its drafter (real
    speculative decoding, vLLM's counters on /metrics): the served tau read from the counters
    equals the simulator's tokens per verify step on the same prompts, every request is
    counted, no other traffic; a server serving another drafter shows a different figure."""
    from dflash_etl import evaluate
    from dflash_etl.models.devserver import DevServer

    target, drafter = run / "target", run / "train" / "drafter"
    with DevServer(str(target), drafter=str(drafter)) as server:
        results = evaluate.evaluate(BENCHES[:2], run=run, out=tmp_path, limit=2,
                                    decoding=evaluate.Decoding(16), server=server.url)
    for doc in results.values():
        served = doc["served"]
        assert served["tau"] == pytest.approx(doc["tokens_per_step"], abs=1e-3)
        assert served["drafts"] == doc["verify_steps"] and not served["failed"]
        assert served["requests"] == sum(p["turns"] for p in doc["per_prompt"])
        assert served["other_traffic_tokens"] == 0
        assert json.loads((tmp_path / f"{doc['benchmark']}.json").read_text())["served"] == served
        # the served figure is pooled per step: named so, beside the offline figure pooled so
        line = "; ".join(evaluate._summary_parts(doc))
        assert f"served: {served['tau']:.3f} tokens per step pooled over" in line
        assert "served tau" not in line and f"{doc['tokens_per_step']:.3f} tokens per step" in line
        assert "below_offline" not in served and "WARNING" not in line
    trained = results["mt_bench_question"]["served"]["tau"]
    with DevServer(str(target), drafter=str(_untrained_copy(drafter, tmp_path))) as server:
        other = evaluate.evaluate(BENCHES[:1], out=tmp_path / "other", limit=2,
                                  decoding=evaluate.Decoding(16), server=server.url)
        assert "tau" not in other["mt_bench_question"]  # served only: no drafter given here
        assert other["mt_bench_question"]["served"]["tau"] < trained
        # the run's drafter offline beside a deployment serving another, on prompts of the
        # run's own kind (the embedded default's prompt-only source): the gap is named
        both = evaluate.evaluate([str(REPO / "data" / "sources" / "prompts.jsonl")], run=run,
                                 out=tmp_path / "both", limit=4, decoding=evaluate.Decoding(16),
                                 server=server.url)
    doc = both["prompts"]
    assert doc["served"]["tau"] < evaluate.SERVED_GAP * doc["tokens_per_step"]
    line = "; ".join(evaluate._summary_parts(doc))
    assert "WARNING: the server's" in line and "does not serve what was trained" in line
    for cause in ("drafter directory", "target_layer_ids", "thinking", "sliding window"):
        assert cause in doc["served"]["below_offline"]


def _untrained_copy(drafter: Path, tmp_path: Path) -> Path:
    from dflash_etl.models.drafter import DFlashDrafter

    torch.manual_seed(0)
    fresh = DFlashDrafter(DFlashDrafter.load(drafter).config)
    fresh.save(tmp_path / "untrained")
    return tmp_path / "untrained"


def test_a_server_that_does_not_speculate_is_refused(tmp_path):
    from dflash_etl import evaluate
    from dflash_etl.models.devserver import DevServer

    with DevServer(None, instant=True) as server, pytest.raises(
            StageError, match=r"has no vllm:spec_decode_num_drafts counter.*--speculative-config"):
        evaluate.evaluate(BENCHES[1:2], out=tmp_path, limit=1, server=server.url)


def test_sampled_eval_is_seeded(run):
    """At a temperature the same seed gives the same draws (per item, whatever else is drawn),
    another seed other ones; the target's own greedy drafts are then only sometimes accepted."""
    import dataclasses

    from dflash_etl import evaluate
    from dflash_etl.io.benchmarks import read_benchmark

    evaluator = evaluate.Evaluator(run / "train" / "drafter", str(run / "target"), {},
                                   evaluate.Decoding(24, 0.05, 3))  # the tiny target is flat
    evaluator.propose = _oracle(evaluator.target)
    item = read_benchmark(EVALSETS / "gsm8k_test.jsonl")[0]
    first, again = evaluator.item(item), evaluator.item(item)
    evaluator.decoding = dataclasses.replace(evaluator.decoding, seed=4)
    other = evaluator.item(item)
    assert first == again and first["accepted"] != other["accepted"]
    assert 1 < first["tau"] < evaluator.drafter.config.block_size


def test_a_benchmark_that_cannot_give_a_figure_is_refused_naming_the_file(tmp_path):
    """An empty benchmark file gave "tau 1.000 on 0 prompts", rc 0; two files of one name ran
    one of them (reliability issue, item 7)."""
    from dflash_etl.evaluate import _benchmark_items

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(StageError, match=r"empty\.jsonl holds no benchmark item"):
        _benchmark_items([empty], None, 0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "gsm8k.jsonl").write_text('{"prompt": "What is 2 + 2?"}\n')
    with pytest.raises(StageError, match="two benchmark files share the name 'gsm8k'"):
        _benchmark_items([tmp_path / "a" / "gsm8k.jsonl", tmp_path / "b" / "gsm8k.jsonl"],
                         None, 0)


def test_rows_rendered_with_another_template_than_the_targets_are_served_and_measured_with_it(
        run, tmp_path, monkeypatch):
    """The failure-mode benchmark's h: the target directory's own chat template is not the one
    tokenize rendered the rows with (a template patched to get past a strict probe, say). The
    serve line makes vLLM render with the rows' template (`--tokenizer` naming tokenize's
    tokenizer), and eval renders the prompts with it: the tau is the one the drafter earns
    on its own contexts, equal to eval with the run's target; with the target's own template
    the prompts, and the tau, would differ."""
    import shutil

    from dflash_etl import evaluate
    from dflash_etl.core.rundir import RunDir
    from dflash_etl.models.serving import rows_template, vllm_serve_command

    target = run / "target"
    assert rows_template(RunDir(run), target).flags == ""  # the run's own: nothing to add
    patched = Path(shutil.copytree(target, tmp_path / "patched-target"))
    template = (patched / "chat_template.jinja").read_text()
    (patched / "chat_template.jinja").write_text("Answer in English.\n" + template)
    found = rows_template(RunDir(run), patched)
    tokenizer_dir = json.loads((run / "manifest.json").read_text())["stages"]["tokenize"][
        "settings"]["model"]
    assert found.flags == f" --tokenizer {tokenizer_dir}" and found.text == template
    line = vllm_serve_command(patched, run / "train" / "drafter", 4, None, found.flags)
    assert line.endswith(f"--tokenizer {tokenizer_dir}")
    kwargs = {"limit": 2, "decoding": evaluate.Decoding(16)}
    own = evaluate.evaluate(BENCHES[1:2], run=run, out=tmp_path / "own", **kwargs)
    served = evaluate.evaluate(BENCHES[1:2], run=run, target=str(patched),
                               out=tmp_path / "patched", **kwargs)
    (name, doc), = served.items()
    assert doc["settings"]["chat_template"] == "the rows'"
    assert doc["tau"] == own[name]["tau"]
    assert doc["per_prompt"] == own[name]["per_prompt"]
    # what eval measured before: the target's own template, other prompts, another tau
    monkeypatch.setattr(evaluate, "_rows_template", lambda run, target: None)
    before = evaluate.evaluate(BENCHES[1:2], run=run, target=str(patched),
                               out=tmp_path / "before", **kwargs)
    assert before[name]["per_prompt"] != own[name]["per_prompt"]
