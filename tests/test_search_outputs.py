"""What ``plan --devices N`` writes beside its table (the best plan's --html page, its --json)
agrees with the table, and what the search refuses is refused in the flag's terms. Tiny presets."""

from __future__ import annotations

import html
import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

from spmdkit.outputs.report import fmt_bytes


def _cli(*args: str) -> tuple[int, str, str]:
    from spmdkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def test_devices_page_compares_the_memory_the_search_priced(tmp_path: Any) -> None:
    # the page's "other plans" table gave each configuration's memory as memory_per_device of its plan
    # without its recomputation, framework or the device's overheads (tens of KiB here for the 768 MiB a
    # device holds), and "this plan" another figure than the page's own card
    page = tmp_path / "best.html"
    rc, out, err = _cli("plan", "--model", "tiny-llama", "--devices", "4", "--json", "--html", str(page))
    assert rc == 0, err
    top = json.loads(out)["search"]["top"]
    text = page.read_text()
    table = text[text.index("<th>memory</th></tr>"):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr><td>([^<]*)</td>(?:<td>[^<]*</td>){3}<td>([^<]*)</td></tr>", table)
    assert len(rows) >= 2 and rows[0] == ("this plan", fmt_bytes(top[0]["memory_per_device"]))
    priced = {fmt_bytes(t["memory_per_device"]) for t in top}
    assert all(mem in priced for _, mem in rows[1:]), rows
    assert f"memory per device<b>{fmt_bytes(top[0]['memory_per_device'])}</b>" in text  # the card


def test_a_device_file_without_memory(tmp_path: Any) -> None:
    # a device file needs no memory_gb (only peak_tflops' fp32 and hbm_gb_per_s): the device holds 0
    # bytes, which plan takes as unknown (no fit verdict); the search fitted every plan into 0 B and
    # reported that none fits, and --stages auto marked every split '(does not fit)'
    dev = tmp_path / "dev.json"
    dev.write_text('{"peak_tflops": {"fp32": 10}, "hbm_gb_per_s": 100}')
    rc, out, err = _cli("plan", "--model", "tiny-llama", "--devices", "2", "--device", str(dev))
    assert rc == 2 and out == ""
    assert err.strip().splitlines()[-1] == (
        "spmdkit plan: ProgramError: --devices: the device 'custom device' states no memory (its file has no "
        "memory_gb and no base), so the search has nothing to fit the plans in: give --memory SIZE, or memory_gb "
        "in the device file")
    rc, out, err = _cli("plan", "--model", "tiny-llama", "--devices", "2", "--device", str(dev), "--memory", "1GB",
                        "--json")
    assert rc == 0 and json.loads(out)["search"]["memory_cap"] == 10**9
    rc, out, err = _cli("plan", "--model", "tiny-llama", "--mesh", "pp=2,dp=1,tp=1", "--strategy", "dp",
                        "--device", str(dev), "--stages", "auto")
    assert rc == 0 and "note: --stages auto: 1,1" in out + err and "fullest rank 0.8 GiB" in out + err
    assert "does not fit" not in out + err


def test_plan_help_names_every_device_preset() -> None:
    # the help listed a100-40gb, a100-80gb, h100, h200: --device h800 plans, and its error names it
    import argparse

    from spmdkit.cli import build_parser
    from spmdkit.cost.devices import DEVICES

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices["plan"]._actions if "--device" in a.option_strings)
    assert action.help is not None and f"a preset ({', '.join(DEVICES)})" in action.help and "h800" in action.help


def test_devices_hf_moe_header_keeps_the_import_note_below(tmp_path: Any) -> None:
    # an HF MoE import's title carries a note line ('note: MoE: ... lowered ...'): the header put
    # 'on 2 devices (...)' at the end of the note, the JSON title ran '; best of 2 devices: ...' into it
    # and the recipe's model (torchtitan's job description) carried the note whole
    from hf_moe_helpers import MIXTRAL

    recipe = tmp_path / "r.json"
    argv = ["plan", "--hf", "MixtralForCausalLM", "--hf-config", json.dumps(MIXTRAL), "--devices", "2", "--seq", "8",
            "--batch", "2", "--strategy", "dp", "--recompute", "none"]
    rc, out, err = _cli(*argv)
    assert rc == 0, err
    first, note = out.splitlines()[:2]
    assert first == "MixtralForCausalLM (HuggingFace), batch 2, seq 8, float32 on 2 devices (NVIDIA H100 SXM5 80GB)"
    assert note.startswith("note: MoE: 1 block(s) lowered") and "devices" not in note
    rc, out, err = _cli(*argv, "--json", "--export-recipe", "json", str(recipe))
    assert rc == 0, err
    title = json.loads(out)["title"].split("\n")
    assert title[0] == "MixtralForCausalLM (HuggingFace), batch 2, seq 8, float32; best of 2 devices: mesh dp=2,tp=1; dp"
    assert title[1] == note
    assert json.loads(recipe.read_text())["model"] == "MixtralForCausalLM (HuggingFace), batch 2, seq 8, float32"


def test_devices_given_strategy_goes_to_the_meshes_it_uses() -> None:
    # --strategy dp was planned on dp=1 x tp=4 (every tp rank the same sequences: four GPUs, one
    # replica) and ranked above the 2 x 2 mesh for its missing gradient reduction; --strategy tp (megatron's
    # alias) was planned on the tp=1 meshes, which are dp, and won there
    from spmdkit.planner.search import search_meshes

    meshes = {s: {(c.config.dp, c.config.tp, c.config.pp) for c in search_meshes("tiny-llama", 4, "h100",
                                                                                strategies=[s], recompute=["none"])
                  .candidates}
              for s in ("dp", "tp", "fsdp", "megatron")}
    assert meshes["dp"] == meshes["fsdp"] == {(4, 1, 1), (2, 1, 2)}
    assert meshes["tp"] == meshes["megatron"] == {(2, 2, 1), (1, 4, 1), (1, 2, 2)}


def test_auto_time_limit_without_auto_is_refused() -> None:
    # it was accepted and changed nothing (its default was the text "60", a given value not told apart)
    for extra in (["--mesh", "dp=2,tp=2"], ["--devices", "2"]):
        rc, out, err = _cli("plan", "--model", "tiny-llama", *extra, "--auto-time-limit", "5")
        assert rc == 2 and out == "" and err.strip() == ("spmdkit plan: ProgramError: --auto-time-limit: applies to "
                                                         "the --auto search (with or without --devices); give --auto too")
    rc, out, err = _cli("plan", "--model", "tiny-llama", "--devices", "2", "--explain")
    assert rc == 2 and "--explain: applies to the --auto search of a --mesh; give --auto too" in err


def test_devices_auto_explain_is_refused() -> None:
    # --devices --auto --explain was accepted and explained nothing (the search keeps no runner-ups)
    rc, out, err = _cli("plan", "--model", "tiny-llama", "--devices", "2", "--auto", "--explain")
    assert rc == 2 and out == "" and err.startswith("spmdkit plan: ProgramError: --explain: applies to the --auto "
                                                    "search of a --mesh")


def test_devices_json_with_nothing_to_plan_says_why() -> None:
    # the text ends with why no configuration could be planned; the JSON had the search alone
    rc, text, _ = _cli("plan", "--model", "tiny-llama", "--devices", "7")
    rc_json, out, _ = _cli("plan", "--model", "tiny-llama", "--devices", "7", "--json")
    got = json.loads(out)
    assert rc == rc_json == 1 and got["search"]["top"] == [] and "title" not in got
    assert got["why"] == text.strip().splitlines()[-1]
    assert got["why"].startswith("no configuration of 7 devices: of the factorisations dp x tp x pp, 1 have a "
                                 "data-parallel degree that does not divide the batch 4")


def test_devices_pipeline_page_times_the_microbatch_on_the_device(tmp_path: Any) -> None:
    # a pipeline best's page was given no step estimate: it timed the microbatch on an H100 and said
    # 'No --device was given' under --device a100-80gb (its error band card the H100 runs')
    cfg = {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8, "num_key_value_heads": 2,
           "num_hidden_layers": 5, "vocab_size": 32000}  # only pp=2 fits 1.3 GiB (test_hf_pipeline_verify)
    page = tmp_path / "p.html"
    rc, out, err = _cli("plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(cfg), "--devices", "2",
                        "--strategy", "dp", "--recompute", "none", "--seq", "64", "--batch", "4", "--memory", "1.3GiB",
                        "--device", "a100-80gb", "--html", str(page))
    assert rc == 0 and "The best: dp=1 tp=1 pp=2" in out, err
    text = page.read_text()
    words = html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text)))
    assert "No --device was given" not in text and "H100" not in text
    assert "whole program on the stages' sub-mesh: On NVIDIA A100 SXM4 80GB:" in words
    band = re.search(r"error band: real step (\S+)-(\S+) x predicted", out)
    assert band is not None and f"error band<b>{band[1]}-{band[2]} x step</b>" in text


def test_a_flag_every_configuration_refuses_is_one_line() -> None:
    # every configuration refused for the same flag was a search with nothing to show (exit 1), its
    # last line blaming the pipeline stages; plan --mesh refuses the flag in one line (exit 2)
    for extra, message in (
            (["--annotate", "zzz=[0,-1]"], "--annotate 'zzz': the program has no such tensor"),
            (["--cp-attention", "ring"], "--cp-attention ring: context parallelism is not asked for"),
            (["--tp-comm-overlap", "--strategy", "megatron"], "--tp-comm-overlap: overlaps sequence parallelism's")):
        rc, out, err = _cli("plan", "--model", "tiny-llama", "--devices", "4", *extra)
        assert rc == 2 and out == "" and err.strip().splitlines()[-1].startswith(f"spmdkit plan: ProgramError: {message}")


def test_cp_options_without_cp_are_refused_before_the_search() -> None:
    """--devices --cp-attention ring without cp in --strategy: the search kept no mesh for a
    strategy of cp's options alone; where the batch refused every other factorisation it ended
    'no configuration ... give --batch 2 or 4' (exit 1), never naming the flag. Refused first,
    saying how --devices takes it."""
    rc, out, err = _cli("plan", "--model", "tiny-llama", "--devices", "4", "--batch", "1", "--cp-attention", "ring")
    assert rc == 2 and out == ""
    assert err.strip().splitlines()[-1] == (
        "spmdkit plan: ProgramError: --cp-attention ring: context parallelism is not asked for; with --devices give "
        "cp in --strategy (e.g. --strategy dp,cp --cp-attention ring: the search tries it on its cp meshes) or drop "
        "--cp-attention")


def test_a_micro_batch_nothing_divides_is_named_with_the_ones_that_do() -> None:
    # '--global-batch 12 --micro-batch 5' said '5 have a data-parallel degree that does not divide the batch
    # 12 ...: give --batch 12' (the batch it had; --batch does not go with --global-batch)
    rc, out, _ = _cli("plan", "--model", "tiny-llama", "--devices", "4", "--global-batch", "12", "--micro-batch", "5")
    assert rc == 1 and out.strip().splitlines()[-1] == (
        "no configuration of 4 devices: of the factorisations dp x tp x pp, 5 whose data-parallel ranks x "
        "--micro-batch do not divide the global batch 12: give --micro-batch 1 or 2 or 3 or 4; 1 more pipeline "
        "stages than layers")
    rc, out, _ = _cli("plan", "--model", "tiny-llama", "--devices", "4", "--global-batch", "3", "--micro-batch", "2")
    assert rc == 1 and "give --global-batch 4, or --devices 3 (dividing 3)" in out.strip().splitlines()[-1]


def test_devices_refused_export_leaves_no_page(tmp_path: Any) -> None:
    # the page was written before the export was refused (exit 2 and a page of a plan not exported)
    page, exp = tmp_path / "p.html", tmp_path / "x.py"
    rc, _out, err = _cli("plan", "--model", "tiny-llama", "--devices", "4", "--html", str(page), "--export", "torch",
                        str(exp))
    assert rc == 2 and "ExportError: --export torch" in err and sorted(tmp_path.iterdir()) == []


def test_devices_pipeline_best_exports_its_stages_to_torch(tmp_path: Any) -> None:
    # a pipeline best was refused ('--export does not apply to one yet (give --mesh without pp)'), where
    # plan --mesh pp=... --export torch writes the stages; now the split the search priced (3, 2)
    cfg = {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8, "num_key_value_heads": 2,
           "num_hidden_layers": 5, "vocab_size": 32000}
    exp = tmp_path / "x.py"
    argv = ["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(cfg), "--devices", "2", "--strategy", "dp",
            "--recompute", "none", "--seq", "64", "--batch", "4", "--memory", "1.3GiB"]
    rc, out, err = _cli(*argv, "--export", "torch", str(exp))
    assert rc == 0 and "The best: dp=1 tp=1 pp=2 (m=4) dp" in out, err
    ns: dict[str, Any] = {}
    text = exp.read_text()
    exec(compile("\n".join(ln for ln in text.splitlines() if ln.startswith(("MESH_", "PIPELINE ="))), "x", "exec"),
         ns)
    assert ns["MESH_DIMS"] == ("pp", "dp", "tp") and ns["MESH_SHAPE"] == (2, 1, 1)
    assert ns["PIPELINE"]["microbatches"] == 4 and [len([m for m in s if m.startswith("model.layers.")])
                                                    for s in ns["PIPELINE"]["stages"]] == [3, 2]
    rc, out, err = _cli(*argv, "--export", "jax", str(tmp_path / "x.json"))
    assert rc == 2 and "--export jax: the best configuration (dp=1 tp=1 pp=2 (m=4) dp) is a pipeline" in err
    assert sorted(tmp_path.iterdir()) == [exp]


def test_plan_json_says_whether_it_fits_as_the_text_does() -> None:
    # the text ends 'memory: fits with ... / does not fit by ...'; the JSON had the bytes alone
    argv = ["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--device", "h100"]
    _, text, _ = _cli(*argv)
    _, out, _ = _cli(*argv, "--json")
    mem = json.loads(out)["memory"]
    assert mem["device_memory"] == 80 * 2**30 and mem["fits"] is True and "memory: fits with" in text
    rc, out, _ = _cli("plan", "--model", "llama3-8b", "--layers", "2", "--seq", "8192", "--batch", "64", "--mesh",
                      "dp=1,tp=1", "--strategy", "dp", "--device", "h100", "--json")
    mem = json.loads(out)["memory"]
    assert rc == 0 and mem["fits"] is False and mem["device_total"] > mem["device_memory"]
    _, out, _ = _cli("plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--json")
    assert "fits" not in json.loads(out)["memory"]  # no --device: no verdict (as the text)


def test_the_card_and_the_text_judge_the_search_s_memory_cap(tmp_path: Any) -> None:
    # a 0.5 GB device, --memory 2GB: the table lists plans that fit in 2 GB (tiny-llama's best needs
    # about 0.74 GiB per device); the report's 'memory:' line, the JSON's fits and the --html card's
    # 'fits?' judged it against the 0.5 GB device ('does not fit') while the table said it fits
    dev = tmp_path / "dev.json"
    dev.write_text('{"peak_tflops": {"fp32": 10}, "hbm_gb_per_s": 100, "memory_gb": 0.5}')
    page = tmp_path / "p.html"
    args = ("plan", "--model", "tiny-llama", "--devices", "2", "--device", str(dev), "--memory", "2GB")
    rc, out, _ = _cli(*args, "--html", str(page))
    assert rc == 0 and "configurations that fit in 1.86 GiB per device" in out
    line = next(x for x in out.splitlines() if x.startswith("memory: "))
    # the capacity as the table gives it (1.86 GiB: 2 GB), not rounded to a whole 2 GiB
    assert line.startswith("memory: fits with ") and "% of 1.86 GiB) on a custom device" in line, line
    assert "fits?<b>fits with " in page.read_text()
    rc, out, _ = _cli(*args, "--json")
    got = json.loads(out)
    assert rc == 0 and got["memory"]["device_memory"] == 2 * 10**9 and got["memory"]["fits"] is True
    assert 0.5 * 10**9 < got["memory"]["device_total"] <= 2 * 10**9  # over the device's memory, under the cap


def test_pipeline_json_says_whether_the_fullest_rank_fits(tmp_path: Any) -> None:
    # the text ends 'fullest pipeline rank R: ...; fits with ... / does not fit by ...'; a pipeline's JSON
    # (plan --mesh pp=..., and --devices with a pipeline best) had the fullest rank's bytes alone
    argv = ["plan", "--model", "tiny-llama", "--mesh", "pp=2,dp=2", "--strategy", "dp", "--microbatches", "2"]
    _, text, _ = _cli(*argv, "--device", "h100")
    rc, out, err = _cli(*argv, "--device", "h100", "--json")
    d = json.loads(out)
    mem, ranks = d["memory"], d["pipeline"]["devices"]
    assert rc == 0 and mem["device_memory"] == 80 * 2**30 and mem["fits"] is True, err
    assert mem["device_total"] == max(r["memory"]["device_total"] for r in ranks) and "; fits with" in text
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"base": "h100", "memory_gb": 0.001}))  # 10^6 bytes
    rc, out, err = _cli(*argv, "--device", str(small), "--json")
    mem = json.loads(out)["memory"]
    assert rc == 0 and mem["device_memory"] == 10**6 and mem["fits"] is False, err
    _, out, _ = _cli(*argv, "--json")
    assert "fits" not in json.loads(out)["memory"]  # no --device: no verdict (as the text)
    cfg = {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8, "num_key_value_heads": 2,
           "num_hidden_layers": 5, "vocab_size": 32000}  # only pp=2 fits 1.3 GiB (as above)
    rc, out, err = _cli("plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(cfg), "--devices", "2",
                        "--strategy", "dp", "--recompute", "none", "--seq", "64", "--batch", "4", "--memory", "1.3GiB",
                        "--json")
    d = json.loads(out)
    assert rc == 0 and d["pipeline"]["pp"] == 2, err
    assert d["memory"]["device_memory"] == int(1.3 * 2**30) and d["memory"]["fits"] is True  # the search's cap


def test_plan_refused_export_leaves_no_page(tmp_path: Any) -> None:
    # plan --mesh with a pp dim and plan --auto wrote --html before the export was refused (exit 2 and a page
    # of a plan not exported), as --devices did before dc1a920; plan without either exported first already
    page, exp = tmp_path / "p.html", tmp_path / "x.py"
    for mesh in (["--mesh", "dp=2,pp=2", "--strategy", "dp"], ["--mesh", "dp=2,tp=2", "--auto"],
                 ["--mesh", "dp=2,tp=2"]):
        rc, _out, err = _cli("plan", "--model", "tiny-llama", *mesh, "--html", str(page), "--export", "torch", str(exp))
        assert rc == 2 and "ExportError: --export torch" in err and sorted(tmp_path.iterdir()) == [], (mesh, err)


def test_nothing_fits_names_the_cap_as_the_table_does() -> None:
    # the last line rounded the cap to a tenth of a GiB: a --memory 80 (a byte count) read 'fits in 0.0 GiB'
    # under the table's 'fit in 80 B', a 700 MB one 'fits in 0.7 GiB' under 'fit in 667.57 MiB'
    for cap, said in (("80", "80 B"), ("700MB", "667.57 MiB")):
        rc, out, _ = _cli("plan", "--model", "tiny-llama", "--devices", "2", "--memory", cap)
        assert rc == 1 and f"configurations that fit in {said} per device" in out
        assert out.strip().splitlines()[-1].startswith(f"no configuration fits in {said} per device: the least needs ")
