"""``spmdkit plan --html``: the self-contained page (spmdkit.outputs.html), its numbers against the
plan's, its atomic write, and the page rendered in headless Chromium (skipped, with the reason,
where no Chromium is installed: ``make chromium`` installs Debian's package when root)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_stdout
from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.compute import kernel_collectives
from spmdkit.cost.devices import preset_device
from spmdkit.cost.memory import memory_per_device
from spmdkit.cost.step import estimate_step
from spmdkit.outputs import html as H
from spmdkit.outputs.report import _phase_comm, reshard_groups
from spmdkit.planner.planning import plan_model


class _Page(HTMLParser):
    """Every element's tag and attributes, and the text inside <script> (for the checks)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, {k: v or "" for k, v in attrs}))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)

    def figures(self, kind: str) -> list[dict[str, str]]:
        return [a for t, a in self.elements if t == "svg" and a.get("data-figure") == kind]


def _parse(text: str) -> _Page:
    p = _Page()
    p.feed(text)
    p.close()
    return p


@pytest.fixture(scope="module")
def llama() -> tuple[Any, Any, Any, Any]:
    """A 2-layer llama-7b plan on dp=2,tp=4 with its H100 step and memory."""
    model, plan, _ = plan_model("llama-7b", "dp=2,tp=4", "megatron", {"layers": 2})
    c = model.config
    est = estimate_step(plan, preset_device("h100"), c.batch * c.seq)
    return model, plan, est, memory_per_device(plan)


@pytest.fixture(scope="module")
def page(llama: tuple[Any, Any, Any, Any]) -> str:
    model, plan, est, mem = llama
    return H.render_html(plan, "llama-7b, 2 layers", mem, est, config=model.config)


def test_page_is_self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    # nothing fetched: no external URL, no src / href to another file
    assert not re.search(r"https?://", page)
    assert not re.search(r'\b(src|href)="(?!#)', page)
    p = _parse(page)
    assert len(p.scripts) == 1 and "sortBy" in p.scripts[0]
    assert any(t == "style" for t, _ in p.elements)


def test_page_has_every_figure(page: str, llama: tuple[Any, Any, Any, Any]) -> None:
    _, plan, est, _ = llama
    p = _parse(page)
    prog = plan.program
    for kind in ("mesh", "timeline", "memory", "layer-comm", "layer-memory"):
        assert len(p.figures(kind)) == 1, kind
    # a tensor figure for each tensor of layer 0 (parameters, activations, gradients) and the others
    want = [t.name for t in prog.tensors.values() if t.name.startswith("layers.0.") and not t.inplace_of
            and t.kind in ("parameter", "activation", "gradient")]
    want += [t.name for t in prog.tensors.values() if not t.name.startswith("layers.") and not t.inplace_of
             and t.kind in ("input", "parameter", "activation")]
    assert [a["data-tensor"] for a in p.figures("tensor")] == want
    # the mesh: one cell per rank
    assert sum(1 for t, a in p.elements if t == "g" and a.get("class") == "rank") == plan.mesh.size
    # layers: embedding, layer 0, layer 1, head
    assert p.figures("layer-comm")[0]["data-rows"] == "4"
    # the timeline holds every op of the step and ends where the estimate does
    tl = p.figures("timeline")[0]
    assert int(tl["data-ops"]) == len(prog.ops)
    assert float(tl["data-end"]) == pytest.approx(max([est.step_overlap_s] + [b.start_s + b.time_s
                                                                             for b in est.buckets]), rel=1e-8)
    assert int(tl["data-compute-rects"]) > 10 and int(tl["data-comm-rects"]) > 0
    assert sum(1 for t, a in p.elements if t == "rect" and a.get("class") == "bucket") == len(est.buckets)
    # no --auto, no alternatives: no search section at all
    assert 'id="auto"' not in page


def test_tensor_pictures_match_the_placements(page: str) -> None:
    p = _parse(page)
    figs = {a["data-tensor"]: a for a in p.figures("tensor")}
    assert figs["layers.0.wq"]["data-blocks"] == "4"          # tp shards, each on a dp pair
    assert figs["layers.0.attn_norm"]["data-blocks"] == "1"   # replicated
    assert figs["layers.0.q"]["data-blocks"] == "8"           # batch over dp, heads over tp
    titles = re.findall(r'data-tensor="layers\.0\.wq".*?</svg>', page)[0]
    assert re.findall(r"ranks ([\d,\-]+)</title>", titles) == ["0,4", "1,5", "2,6", "3,7"]
    # a partial gradient is hatched; a sharded activation is not
    wq_grad = re.findall(r'data-tensor="layers\.0\.wq\.grad".*?</svg>', page)[0]
    assert wq_grad.count('class="partial"') == 4
    q = re.findall(r'data-tensor="layers\.0\.q".*?</svg>', page)[0]
    assert 'class="partial"' not in q


def test_shard_blocks_co_shard_and_rows() -> None:
    mesh = ProcessMesh([2, 4], dim_names=["dp", "tp"])
    rows, cols, blocks = H.shard_blocks(TensorDistAttr(mesh, ((0, 1), -1)), 2)
    assert (rows, cols) == (8, 1)
    assert blocks == {(r, 0): [r] for r in range(8)}          # major dp, then tp: rank order
    rows, cols, blocks = H.shard_blocks(TensorDistAttr(mesh, (1, -1, 0)), 3)
    assert (rows, cols) == (4, 2)                             # axes 0 and 1 in the rows, axis 2 across
    assert blocks[(2, 1)] == [6] and blocks[(0, 0)] == [0]
    assert H.shard_blocks(TensorDistAttr(mesh, ()), 0) == (1, 1, {(0, 0): list(range(8))})


def test_layer_bars_add_up_to_the_plan(llama: tuple[Any, Any, Any, Any]) -> None:
    _, plan, _, mem = llama
    rows = H.layer_table(plan, mem)
    assert [r["layer"] for r in rows] == ["embedding", "layer 0", "layer 1", "head"]
    comm = sum(r["forward"] + r["backward"] + r["optimizer"] for r in rows)
    assert comm == pytest.approx(_phase_comm(plan, kernel_collectives(plan), None)[1], rel=1e-9)
    assert sum(r["parameters"] for r in rows) == mem.parameters
    assert sum(r["gradients"] for r in rows) == mem.gradients
    assert sum(r["optimizer_states"] for r in rows) == mem.optimizer_states
    assert sum(r["activations"] for r in rows) == mem.saved.total
    assert rows[1]["forward"] > 0 and rows[1]["optimizer"] > 0  # tp all-reduces, the wq.grad dp all-reduce


def test_memory_curve_and_peak(page: str, llama: tuple[Any, Any, Any, Any]) -> None:
    _, plan, _, mem = llama
    assert len(mem.curve) == len(plan.program.ops)
    assert max(mem.curve) == mem.activation_peak == mem.curve[mem.peak_op]
    fig = _parse(page).figures("memory")[0]
    assert int(fig["data-peak"]) == mem.total
    assert 'class="peak"' in page


def test_reshard_table_rows(page: str, llama: tuple[Any, Any, Any, Any]) -> None:
    _, plan, _, _ = llama
    groups = reshard_groups(plan)
    p = _parse(page)
    body_rows = [a for t, a in p.elements if t == "tr" and "data-phase" in a]
    assert [a["data-phase"] for a in body_rows] == [g["phase"] for g in groups]
    assert f"{len(groups)} of {len(groups)} rows" in page


def test_alternatives_and_auto_section(llama: tuple[Any, Any, Any, Any]) -> None:
    from spmdkit.planner.auto import AutoInfo

    _model, plan, est, mem = llama
    _, dp_plan, _ = plan_model("llama-7b", "dp=2,tp=4", "dp", {"layers": 2})
    info = AutoInfo(objective_s=0.01, gap=0.0, solve_s=0.5, status="Optimal", candidates=10, variables=20)
    text = H.render_html(plan, "t", mem, est, auto=info, alternatives=[("dp only", dp_plan, 3 << 30)])
    p = _parse(text)
    fig = p.figures("alternatives")
    assert len(fig) == 1 and fig[0]["data-rows"] == "2"
    assert "HiGHS Optimal" in text and "dp only" in text
    assert 'id="runner-ups"' not in text  # no --explain rows: no runner-up table


def test_auto_runner_ups_from_explain(llama: tuple[Any, Any, Any, Any]) -> None:
    from spmdkit.planner.auto import AutoInfo, LayerChoice

    _model, plan, est, mem = llama
    rows = [LayerChoice("layers 0", 30, "wq [-1,1] -> [0,-1,1]", 0.020, 0.023, "wq [-1,-1] -> [0,-1,-1]"),
            LayerChoice("head", 5, "", 0.020, None, "-")]
    info = AutoInfo(objective_s=0.02, gap=0.0, solve_s=0.5, status="Optimal", candidates=10, variables=20,
                    explain=rows)
    text = H.render_html(plan, "t", mem, est, auto=info)
    table = text[text.index('id="runner-ups"'):]
    table = table[:table.index("</table>")]
    assert table.count("<tr>") == 3  # the header and one row per layer group
    assert "layers 0" in table and "wq [-1,-1] -&gt; [0,-1,-1]" in table and "+3.00 ms" in table
    assert "(no matmul)" in table


def test_pipeline_schedule_figure(tmp_path: Path) -> None:
    out = tmp_path / "pp.html"
    rc, _ = cli_stdout("plan", "--model", "llama-7b", "--mesh", "pp=2,dp=2,tp=2", "--layers", "4",
                       "--microbatches", "4", "--device", "h100", "--nodes-of", "4", "--html", str(out))
    assert rc == 0
    text = out.read_text()
    p = _parse(text)
    fig = p.figures("pipeline")
    assert len(fig) == 1 and fig[0]["data-units"] == str(2 * 2 * 4)  # F and B of 4 microbatches on 2 ranks
    assert sum(1 for t, a in p.elements if t == "g" and a.get("class") == "rank") == 8   # the full mesh
    assert "2 nodes of 4 ranks" in text and "across nodes" in text
    # the card's communication is the one-microbatch program's (the step section's), beside the pipeline's
    # step of 4 microbatches: it was labelled 'communication' alone, as a flat plan's whole step
    assert "<div>communication (a microbatch, all stages)<b>" in text and "<div>communication<b>" not in text


def test_cli_writes_the_page_and_keeps_json_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.html"
    rc, stdout = cli_stdout("plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--json", "--html", str(out))
    assert rc == 0
    json.loads(stdout)  # stdout is still one JSON document
    assert out.stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().err
    assert "No --device was given" in out.read_text()
    assert [f.name for f in tmp_path.iterdir()] == ["plan.html"]  # no temporary file left


def test_bad_html_path_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _ = cli_stdout("plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--html", str(tmp_path / "no" / "p.html"))
    err = capsys.readouterr().err
    assert rc == 2 and "--html" in err and "does not exist" in err and "Traceback" not in err
    rc, _ = cli_stdout("plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--html", str(tmp_path))
    assert rc == 2 and "is a directory" in capsys.readouterr().err


def test_write_is_atomic(tmp_path: Path, llama: tuple[Any, Any, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    _, plan, est, mem = llama
    target = tmp_path / "plan.html"
    target.write_text("the old page")

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(H.os, "replace", fail)
    with pytest.raises(ProgramError, match=r"--html .*No space left"):
        H.save_html(str(target), plan, "t", mem, est)
    assert target.read_text() == "the old page"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["plan.html"]
    monkeypatch.undo()
    n = H.save_html(str(target), plan, "t", mem, est)
    assert target.stat().st_size == n and target.read_text().startswith("<!DOCTYPE html>")


# -- in a browser ---------------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


CHROMIUM = _chromium()
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install "
                                                             "chromium; `make chromium` does it when root)")


def _browse(path: Path, fragment: str = "") -> tuple[str, list[str]]:
    """(the DOM after the page's script ran, the console messages) of ``path`` in headless Chromium."""
    assert CHROMIUM is not None
    url = path.resolve().as_uri() + fragment
    res = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-extensions", f"--user-data-dir={path.parent / 'profile'}",
                          "--enable-logging=stderr", "--v=0", "--dump-dom", url],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    console = [ln for ln in res.stderr.splitlines() if ":CONSOLE" in ln]
    return res.stdout, console


def _body(dom: str) -> dict[str, str]:
    m = re.search(r"<body([^>]*)>", dom)
    assert m, dom[:500]
    return dict(re.findall(r'([\w-]+)="([^"]*)"', m.group(1)))


@needs_chromium
def test_chromium_detects_a_broken_page(tmp_path: Path) -> None:
    """The browser check itself can fail: a page whose script throws is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    _dom, console = _browse(bad)
    assert any("undefinedFunction" in ln for ln in console)


@needs_chromium
def test_page_renders_in_chromium(tmp_path: Path, page: str, llama: tuple[Any, Any, Any, Any]) -> None:
    _, plan, _, _ = llama
    f = tmp_path / "plan.html"
    f.write_text(page)
    dom, console = _browse(f, "#selftest")
    assert console == []
    body = _body(dom)
    assert body.get("data-ready") == "yes" and "data-errors" not in body
    n_svg = len(re.findall(r'<svg class="fig', page))
    assert body["data-svg"] == str(n_svg) and n_svg > 50
    # the DOM the browser built has the figures (the mesh's ranks, the timeline's rects)
    assert dom.count('class="rank"') == plan.mesh.size
    assert dom.count('data-figure="timeline"') == 1 and dom.count('class="bucket"') > 0
    # sorting by time (descending) and filtering on "optimizer" ran in the page
    assert body["data-selftest-sorted"] == "yes"
    want = sum(1 for g in reshard_groups(plan) if "optimizer" in " ".join(
        str(v) for v in g.values()).lower())
    assert body["data-selftest-filtered"] == str(want) and 0 < want < len(reshard_groups(plan))
    cards = re.findall(r'<div class="card" data-name="([^"]+)"', page)
    assert body["data-selftest-tensors"] == str(sum("wq" in n for n in cards)) != "0"


def test_the_step_section_has_the_report_s_context_parallel_lines(tmp_path: Path) -> None:
    """A cp plan's page gives what the text report gives below its step table: the ring's row and
    its exposure line, the causal imbalance without zig-zag, the recomputation's row and the
    total (the page had none of them: a reader of the page could not see the ring exposed)."""
    out = tmp_path / "cp.html"
    argv = ["plan", "--model", "llama3-8b", "--mesh", "dp=2,cp=4", "--strategy", "dp,cp", "--cp-attention", "ring",
            "--cp-balance", "none", "--seq", "8192", "--batch", "2", "--layers", "2", "--device", "h100",
            "--recompute", "selective"]
    rc, text = cli_stdout(*argv, "--html", str(out))
    assert rc == 0
    step = out.read_text()
    step = step[step.index('<section id="step">'):]
    step = step[:step.index("</section>")]
    lines = [ln for ln in text.splitlines() if ln.startswith(("ring attention over cp=4:", "causal imbalance:"))]
    assert len(lines) == 2
    for ln in lines:
        assert f"<p>{H.esc(ln)}</p>" in step
    for row in ("ring attention (KV blocks passed round cp)", "recomputation (selective)", "total"):
        assert f"<tr><td>{row}</td>" in step


def test_a_moe_pipeline_page_has_the_report_s_moe_memory_breakdown(tmp_path: Path) -> None:
    """The text report of a MoE pipeline splits the fullest rank's memory into its experts and
    the rest, with the divisors (ep, edp, the dense data-parallel ranks); the page had the
    per-rank totals alone."""
    out = tmp_path / "moe.html"
    cfg = json.dumps({"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8, "layers": 2})
    rc, text = cli_stdout("plan", "--model-config", cfg, "--mesh", "pp=2,dp=2,ep=2", "--strategy", "dp,ep", "--batch",
                          "8", "--html", str(out))
    assert rc == 0
    head = next(ln for ln in text.splitlines() if ln.startswith("MoE memory of pipeline rank"))
    page = out.read_text()
    assert H.esc(head) in page[page.index('<section id="memory">'):]
