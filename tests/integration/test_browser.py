"""The training notebook as its users see it: real JupyterLab, real headless Chromium, Run All through the UI.

`pytest -m browser` runs just this. It starts JupyterLab on 127.0.0.1 (a free port, a token) with its own
config/data/settings/runtime folders in tmp (autosave off; the kernel "qwen3-workbench" is this interpreter with
this checkout on PYTHONPATH), serves a copy of `notebooks/02_native.ipynb` from a tmp root (training output in
tmp too, so nothing is written into the repository), and drives the system Chromium through chromedriver
(Debian `chromium` + `chromium-driver`; nothing is downloaded at run time). It checks, in the page:

1. Run All: while torchrun trains, the dashboard's step counter advances and a curve image is shown; at the end
   the widgets give way to the static figure and the summary line "steps 1–8 of 8".
2. Run All again into the same run folder (the trainer replaces metrics.jsonl): the same again (the dashboard
   used to stay at "waiting for the first step…" and end with "no steps logged").
   While it waits for the first step no broken image is shown (an image widget without data is hidden).
3. File → Save Notebook As…: the saved file holds the figure and summary but no widget placeholders
   ("0%| | 0/8", "VBox(children=…)", widget-view outputs), and it reopens showing just that.
4. 07_memory_plan, Run All: no cell's last output is a raw dict, the plan is a table with "other temporaries" split
   into its parts, and the trn2 plans are a numeric table. (nbval fails any notebook cell whose result is a raw dict
   as it runs every notebook: notebooks/conftest.py; running the others here too would double their cost.)

Screenshots of each stage go to `<run folder>/screens/`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
INSTALL = ("install it with `apt-get install -y chromium chromium-driver` (Debian) and "
           "`pip install -e '.[dev]'` (jupyterlab, selenium); .ci/run does both")

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.machine_cpu_path]  # no stored number here

STALE = ("VBox(children", "0%|", "waiting for the first step", "application/vnd.jupyter.widget-view+json",
         "no steps logged")


def _require_browser():
    missing = [n for n, ok in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not ok]
    for mod in ("jupyterlab", "selenium"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        pytest.skip(f"real-browser test needs {', '.join(missing)}: {INSTALL}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float, interval: float = 0.25):
    """Polls `check()` until it returns something truthy; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _lab_dirs(tmp: Path, kernel_name: str) -> dict[str, str]:
    """Environment of a JupyterLab isolated in `tmp`: own kernel spec, settings (no autosave), runtime."""
    data, settings = tmp / "jupyter-data", tmp / "lab-settings"
    spec = data / "kernels" / kernel_name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Qwen3 workbench (browser test)", "language": "python",
        "env": {"PYTHONPATH": str(ROOT)}}))
    for plugin, values in {
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        path = settings / (plugin + ".jupyterlab-settings")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = {k: v for k, v in os.environ.items() if k not in ("WORKBENCH_DASHBOARD", "JUPYTER_PATH")}
    env.update(JUPYTER_DATA_DIR=str(data), JUPYTER_CONFIG_DIR=str(tmp / "jupyter-config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "jupyter-runtime"), JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "lab-workspaces"), PYTHONPATH=str(ROOT),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _notebook_copy(lab_root: Path, name: str, **params: object) -> str:
    """notebooks/<name>.ipynb copied into `lab_root` with parameters replaced; returns its kernel name."""
    nb = nbformat.read(str(ROOT / "notebooks" / f"{name}.ipynb"), as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    for key, value in params.items():
        cell.source, n = re.subn(rf'(?m)^{key} = .*$', f"{key} = {value!r}", cell.source)
        assert n == 1, f"{name}'s parameters cell has no {key} line"
    # Relative config paths are the repository's: the copy runs from lab_root, so make them absolute.
    cell.source = re.sub(r'"(configs/[\w.]+\.toml)"', lambda m: repr(str(ROOT / m[1])), cell.source)
    nbformat.write(nb, str(lab_root / f"{name}.ipynb"))
    return nb.metadata.kernelspec.name


@pytest.fixture
def lab(tmp_path):
    """A running JupyterLab (isolated in tmp_path) and a headless Chromium page; yields a small helper."""
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    lab_root, dump = tmp_path / "lab", tmp_path / "outputs"
    lab_root.mkdir()
    name, kernel = "02_native.ipynb", _notebook_copy(lab_root, "02_native", dump_folder=str(dump))
    _notebook_copy(lab_root, "07_memory_plan", replan=0)  # the plan's tables, without the re-plan's second trace
    env = _lab_dirs(tmp_path, kernel)
    port, token = _free_port(), "browser-test-" + os.urandom(8).hex()
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={lab_root}",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI runs as root
        cwd=lab_root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            return urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).status == 200
        except OSError:
            if server.poll() is not None:
                raise AssertionError(
                    "JupyterLab exited:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:]) from None
            return False

    driver = None
    try:
        _wait("JupyterLab to answer", up, timeout=120, interval=0.5)
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    "--window-size=1600,1000", "--no-first-run", "--disable-extensions"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        driver.set_page_load_timeout(120)
        shots = dump / "nb02_native" / "screens"
        yield _Page(driver, base, token, lab_root, name, dump / "nb02_native", shots)
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


class _Page:
    """The JupyterLab page, driven through its menus; reads state with small DOM queries."""

    def __init__(self, driver, base, token, lab_root, name, run_dir, shots):
        self.driver, self.base, self.token, self.lab_root, self.name = driver, base, token, lab_root, name
        self.run_dir, self.shots = run_dir, shots

    def open(self, name: str) -> None:
        self.driver.get(f"{self.base}/lab/tree/{name}?token={self.token}")
        _wait(f"{name} to open with an idle kernel", lambda: self.js(
            "const p = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');"
            "return !!p && p.querySelectorAll('.jp-Cell').length > 5 &&"
            " !!p.querySelector('.jp-Notebook-ExecutionIndicator[data-status=\"idle\"]');"),
            timeout=180, interval=0.5)

    def js(self, script: str):
        return self.driver.execute_script(script)

    def menu(self, top: str, label: str) -> None:
        """Clicks menu `top` (e.g. "Run"), then its entry whose label starts with `label` (e.g. "Run All Cells")."""
        from selenium.webdriver.common.by import By

        item = next(e for e in self.driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item")
                    if e.text.strip() == top)
        item.click()
        entries = _wait(f"menu entry {top} → {label}", lambda: [
            e for e in self.driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-menu .lm-Menu-item")
            if e.text.strip().startswith(label)], timeout=20)
        entries[0].click()

    def training_cell(self) -> dict:
        """What the training cell's output area shows now (status text, widget/image/text presence)."""
        return self.js("""
            const cell = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')]
                .find(c => (c.querySelector('.jp-InputArea').textContent || '').includes('train_with_dashboard('));
            if (!cell) return null;
            const out = cell.querySelector('.jp-OutputArea');
            const imgs = [...out.querySelectorAll('img')].filter(i => i.complete && i.naturalWidth > 100);
            // shown, but without a picture: the browser's broken-image icon
            const broken = [...out.querySelectorAll('img')].filter(i => i.offsetParent !== null &&
                (!i.getAttribute('src') || (i.complete && i.naturalWidth === 0))).length;
            return {text: out.innerText, widgets: out.querySelectorAll('.widget-progress, .jupyter-widgets').length,
                    widgetImage: [...out.querySelectorAll('.jupyter-widgets img, img.widget-image')]
                        .filter(i => i.complete && i.naturalWidth > 100).length,
                    images: imgs.length, broken: broken,
                    prompt: cell.querySelector('.jp-InputPrompt').textContent.trim()};
        """)

    def last_prompt(self) -> str:
        return self.js("const c = document.querySelectorAll("
                       "'.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt');"
                       "return c.length ? c[c.length - 1].textContent.trim() : '';")

    def shot(self, name: str) -> None:
        self.shots.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(self.shots / f"{name}.png"))

    def scroll_to(self, source: str) -> None:
        """Scrolls the code cell whose source contains `source` to the top of the view."""
        self.js("const c = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')]"
                f".find(c => c.querySelector('.jp-InputArea').textContent.includes({json.dumps(source)}));"
                "if (c) c.scrollIntoView({block: 'start'});")
        time.sleep(0.3)  # a windowed notebook renders the outputs that came into view

    def scroll_to_training_cell(self) -> None:
        self.js("const c = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')]"
                ".find(c => c.querySelector('.jp-InputArea').textContent.includes('train_with_dashboard('));"
                "if (c) c.scrollIntoView({block: 'start'});")

    def run_all_and_watch(self, label: str) -> dict:
        """Run → Run All Cells; records the dashboard's step counter while training; returns what was seen."""
        def count(prompt: str) -> int:  # "[14]:" -> 14; "[ ]:", "[*]:" -> 0
            return int(m[1]) if (m := re.fullmatch(r"\[(\d+)\]:", prompt)) else 0

        before = count(self.last_prompt())  # done = the last cell shows a newer execution count than that
        self.menu("Run", "Run All Cells")
        steps, image_seen, shot_taken, broken = [], False, False, []
        deadline = time.monotonic() + 300

        while time.monotonic() < deadline:
            state = self.training_cell() or {}
            m = re.search(r"step (\d+)/8", state.get("text", ""))
            if state.get("widgets") and m and (not steps or steps[-1] != int(m[1])):
                steps.append(int(m[1]))
            image_seen |= bool(state.get("widgets") and state.get("widgetImage"))
            if state.get("broken"):
                broken.append(state.get("text", "")[:200])
                if len(broken) == 1:
                    self.scroll_to_training_cell()
                    self.shot(f"{label}-broken-image")
            if state.get("widgets") and not steps and not shot_taken and "starting:" in state.get("text", ""):
                self.scroll_to_training_cell()
                self.shot(f"{label}-waiting")
            if image_seen and len(steps) >= 2 and not shot_taken:
                self.scroll_to_training_cell()
                self.shot(f"{label}-training")
                shot_taken = True
            if count(self.last_prompt()) > before:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"{label}: Run All did not finish in 300 s; dashboard showed steps {steps}")
        self.scroll_to_training_cell()
        self.shot(f"{label}-done")
        return {"steps": steps, "image_seen": image_seen, "final": self.training_cell(), "broken": broken}

    def run_all(self, name: str, timeout: float) -> None:
        """Opens `name`, Run → Run All Cells, and waits until its last code cell has run (or an error shows)."""
        self.open(name)
        self.menu("Run", "Run All Cells")

        def finished():
            return self.js("""
                const p = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
                if (p.querySelector('[data-mime-type="application/vnd.jupyter.error"]')) return 'error';
                const prompts = [...p.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim());
                return prompts.length && prompts.every(t => /^\\[\\d+\\]:$/.test(t)) ? 'done' : '';
            """)

        assert _wait(f"{name} to run", finished, timeout=timeout, interval=0.5) == "done", f"{name} failed"

    def cell_results(self) -> list[dict]:
        """Each code cell's source head and what its outputs show: text, whether a table / image is rendered."""
        return self.js("""
            return [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')].map(c => {
                const outs = [...c.querySelectorAll('.jp-OutputArea-output')];
                const last = outs.length ? outs[outs.length - 1] : null;
                return {source: c.querySelector('.jp-InputArea').textContent.slice(0, 80),
                        lastText: last ? last.innerText : '',
                        tables: [...c.querySelectorAll('.jp-OutputArea table')].map(t => t.innerText)};
            });
        """)


RAW_DICT = re.compile(r"^\{['\"].*\}$", re.S)


def _assert_dashboard(seen: dict, label: str) -> None:
    steps, final = seen["steps"], seen["final"]
    assert not seen["broken"], f"{label}: a broken image was shown while waiting: {seen['broken'][:3]}"
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] > steps[0], \
        f"{label}: the step counter did not advance while training (seen: {steps}); final output:\n{final['text']}"
    assert seen["image_seen"], f"{label}: no curve image in the live dashboard"
    assert "steps 1–8 of 8" in final["text"] and "finished" in final["text"], final["text"]
    assert final["widgets"] == 0 and final["images"] >= 1, f"{label}: widgets not replaced by the figure: {final}"
    for stale in STALE:
        assert stale not in final["text"], f"{label}: stale dashboard text {stale!r} in:\n{final['text']}"


def test_run_all_twice_then_save_in_jupyterlab(lab):
    lab.open(lab.name)
    first = lab.run_all_and_watch("1-first-run")
    _assert_dashboard(first, "first Run All")
    records = [json.loads(x) for x in (lab.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))

    second = lab.run_all_and_watch("2-rerun")  # same experiment_name: the trainer replaces metrics.jsonl
    _assert_dashboard(second, "second Run All (same run folder)")

    lab.menu("File", "Save Notebook As")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    field = _wait("the Save As dialog", lambda: lab.driver.find_elements(By.CSS_SELECTOR, ".jp-Dialog input"), 30)[0]
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys("saved_copy.ipynb", Keys.ENTER)
    saved = lab.lab_root / "saved_copy.ipynb"
    _wait("saved_copy.ipynb on disk", lambda: saved.is_file() and saved.stat().st_size > 1000, 60)
    nb = nbformat.read(str(saved), as_version=4)
    cell = next(c for c in nb.cells if "train_with_dashboard(" in c.source)
    raw = json.dumps(cell.outputs, ensure_ascii=False)
    for stale in STALE:
        assert stale not in raw, f"saved notebook keeps stale widget output {stale!r}: {raw[:2000]}"
    assert any("image/png" in o.get("data", {}) for o in cell.outputs), "saved training cell lost its figure"
    assert "steps 1–8 of 8" in raw

    lab.open("saved_copy.ipynb")  # reopened: what a reader (or GitHub / nbviewer) sees
    def rendered():  # outputs render after the cells appear, and only near the viewport (windowed notebook)
        lab.scroll_to_training_cell()
        state = lab.training_cell()
        return state if state and state["images"] and "steps 1–8 of 8" in state["text"] else None

    reopened = _wait("the reopened notebook's training output", rendered, timeout=60, interval=0.5)
    lab.shot("3-reopened-saved")
    for stale in STALE:
        assert stale not in reopened["text"], f"reopened notebook shows {stale!r}:\n{reopened['text']}"



def test_memory_plan_notebook_in_jupyterlab(lab):
    """07 in a lab of its own: opened after the 02 session's notebooks (same lab), its Run All never reached the
    kernel in the fresh-clone run (the kernel sat idle for 240 s); as the first notebook of a lab it runs."""
    lab.run_all("07_memory_plan.ipynb", timeout=240)
    for i, text in enumerate(("plan_table(p)", "plan_advice(p)", "trn2_plans_table(plans)", "plan_chart(")):
        lab.scroll_to(text)
        lab.shot(f"4-07_memory_plan-{i}")
    cells = lab.cell_results()
    for cell in cells:  # a raw dict reads "{'steps logged': 8, ...}"
        assert not RAW_DICT.match(cell["lastText"].strip()), f"07: raw dict output of {cell['source']!r}"
    plan_table = next((t for c in cells for t in c["tables"] if "other temporaries" in t), "")
    for part in ("backward temporaries", "unsharded gradients", "reduce-scatter buffers", "inputs", "peak"):
        assert part in plan_table, f"07's plan table lacks {part!r}:\n{plan_table}"
    trn2 = next((t for c in cells for t in c["tables"] if "qwen3_trainium · native" in t), "")
    assert re.search(r"qwen3_trainium · native\s+[\d.]+\s+[\d.]+", trn2), f"07 has no trn2 table:\n{trn2}"
