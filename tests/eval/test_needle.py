"""The retrieval probe on SmolLM2-135M at a short length: the 16-bit cache finds the key, an evictor
whose budget leaves the key's depth out loses it, and the report carries the column."""

from __future__ import annotations

import csv
import json
import math

import pytest

from kvguard.errors import ConfigError
from kvguard.eval import report
from kvguard.eval.cli import main
from kvguard.eval.evaluate import Report
from kvguard.eval.harness import Summary
from kvguard.eval.methods import builtin_methods
from kvguard.eval.needle import add_retrieval, answer, methods_for, trials
from kvguard.eval.settings import ProbeSettings, Settings
from kvguard.eval.texts import stdlib_code

pytestmark = [pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated"),
              pytest.mark.xdist_group("eval-needle")]  # its module fixture runs once, on one worker
SMALL = Settings(prefix=128, score=64, budget=128)
PROBE = ProbeSettings(length=320, depths=(0, 100), seeds=1, chunk=32, text="stdlib-code")


def row(name: str, kind: str, key: str) -> Summary:
    return Summary(name, kind, key, "", 0.0, 0.0, 0.0, [0.0], 10.0, 0.0, 0.0, 1.0, 1.0, 0, 1.0, 1.0, 1.0, True)


@pytest.fixture(scope="module")
def probed(smollm2):
    model, tok = smollm2
    methods = builtin_methods(SMALL.budget)
    rows = [row("none", "baseline", "fp16"), row("streamingllm", "evictor", methods["streamingllm"].key),
            row("int8-window", "codec", methods["int8-window"].key)]
    r = Report("SmolLM2", SMALL, {"stdlib-code": 1}, rows)
    add_retrieval(r, model, tok, stdlib_code(), methods_for(rows, methods), PROBE, progress=False)
    return r


def test_prompts_plant_the_key_at_each_depth(smollm2):
    tok = smollm2[1]
    p = ProbeSettings(length=400, depths=(0, 50, 100), seeds=2)
    got = trials(tok, stdlib_code(), p)
    assert [(t.depth, t.seed) for t in got] == [(0, 0), (50, 0), (100, 0), (0, 1), (50, 1), (100, 1)]
    assert all(t.ids.shape == (1, 400) and len(t.key) == 5 and t.key.isdigit() for t in got)
    assert got[0].key != got[3].key  # each seed its own key (and stretch of text)
    needle = tok(f" The pass key is {got[0].key}.", add_special_tokens=False).input_ids
    where = []
    for t in got[:3]:
        ids = t.ids[0].tolist()
        assert tok.decode(t.ids[0, : t.context]).count(f"The pass key is {t.key}.") == 1
        assert tok.decode(t.ids[0]).endswith("<|im_start|>assistant\nThe pass key is")
        where.append(next(i for i in range(len(ids)) if ids[i:i + len(needle)] == needle))
    # the chat template and the instruction come first (depth 0 is after them); depth 100 is just before
    # the question; line ends move the needle back by at most 64 tokens
    assert 30 < where[0] < 80 and where[0] + 80 < where[1] < where[2] and where[2] > got[2].context - 30
    assert answer(tok, tok(" 48213. Remember").input_ids) == "48213" and answer(tok, []) == ""

    class Base:  # a tokenizer without a chat template: the same words, no turns
        chat_template = None
        __call__, decode = tok.__call__, tok.decode

    (plain,) = trials(Base(), stdlib_code(), ProbeSettings(length=400, depths=(50,), seeds=1))
    text = tok.decode(plain.ids[0])
    assert plain.ids.shape == (1, 400) and "<|im_start|>" not in text
    assert text.startswith("There is a pass key") and text.endswith("What is the pass key?\nThe pass key is")


def test_the_16bit_cache_finds_the_key_and_an_evictor_loses_it(probed):
    rows = probed.by_method()
    assert rows["none"].retrieval == [1, 1]  # depth 0 and 100, one seed
    # 4 sinks and the 124 most recent tokens: the key at depth 0, after the instruction, is gone;
    # at depth 100 it sits just before the question, within the window
    assert rows["streamingllm"].retrieval == [0, 1]
    assert rows["int8-window"].retrieval == [1, 1]
    assert all(s.retrieval_s > 0 for s in probed.summaries)


def test_the_report_carries_the_column(probed, tmp_path):
    report.write(probed, tmp_path)
    md = (tmp_path / "fidelity.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| method | configuration"))
    assert head.endswith("| retrieval |")
    assert "| none | `fp16` |" in md and md.count("| 2/2 |") >= 2 and "| 1/2 |" in md
    assert "## Retrieval probe" in md and "| streamingllm | 0/1 | 1/1 | 1/2 |" in md
    assert "depths 0 %, 100 % of stdlib-code, 320-token prompts" in md  # the settings line states the probe
    rows = list(csv.DictReader((tmp_path / "fidelity.csv").open()))
    assert [x["retrieval"] for x in rows if x["method"] == "streamingllm"] == ["1/2"]
    assert "<th>retrieval</th>" in (tmp_path / "fidelity.html").read_text()
    data = json.loads((tmp_path / "fidelity.json").read_text())
    assert data["settings"]["probe"]["depths"] == [0, 100] and data["summaries"][1]["retrieval"] == [0, 1]
    again = report.from_json(data)
    assert report.to_markdown(again) == md and again.settings.probe == PROBE


def test_the_depth_table_counts_each_depth_over_the_seeds():
    from dataclasses import replace

    from kvguard.eval.needle import depth_table

    r = Report("m", replace(SMALL, probe=ProbeSettings(depths=(0, 50, 100), seeds=2)), {"t": 1},
               [row("h2o", "evictor", "h2o")])
    r.summaries[0].retrieval = [0, 0, 1, 0, 1, 1]  # seed 0: depths 0, 50, 100; then seed 1
    assert depth_table(r)[1] == [["h2o", "0/2", "1/2", "2/2", "3/6", "0"]]


def test_a_report_without_the_probe_has_no_column():
    r = Report("m", SMALL, {"t": 1}, [row("none", "baseline", "fp16")])
    assert "retrieval" not in report.to_markdown(r) and "retrieval" not in report.to_rows(r)[0]
    assert row("x", "codec", "int8").retrieval_text == "—" and not math.isnan(r.summaries[0].retrieval_s)


@pytest.mark.parametrize("argv, words", [
    (["--probe-depths", "0,120"], "--probe-depths must be whole percentages from 0 to 100"),
    (["--probe-seeds", "0"], "--probe-seeds must be an integer >= 1"),
    (["--probe-length", "64"], "--probe-length must be an integer >= 128"),
    (["--probe-text", "bible"], "unknown --probe-text 'bible'"),
])
def test_bad_probe_settings_are_errors_before_any_measurement(capsys, argv, words):
    assert main(["--probe", *argv, "--methods", "none", "--texts", "", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvguard eval: error: ") and words in err, err


def test_the_probe_refuses_a_length_the_evictors_would_not_cut(tmp_path, capsys):
    path = tmp_path / "fidelity.json"
    path.write_text(json.dumps(report.to_json(Report("m", Settings(), {"t": 1}, [row("none", "baseline", "fp16")]))))
    assert main(["--from-json", str(path), "--probe", "--probe-length", "512", "--policies", "", "--quiet"]) == 1
    assert "--probe-length 512 is too short for --budget 256" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="does not know the configuration of"):
        methods_for([row("mystery", "policy", "int8")], builtin_methods())
