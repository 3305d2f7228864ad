"""The GPU check (experiments/studies/gpu_check.py) runs with only what a bare GPU image has: torch, transformers,
numpy."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_needs_nothing_beyond_torch_transformers_numpy(tmp_path):
    """What a bare GPU image has is enough: the check pulls in none of the project's other dependencies."""
    code = (
        "import sys, torch\n"
        "from experiments.studies import gpu_check\n"
        "env = gpu_check.environment(torch.device('cpu'), gpu_check.TINY_CHECK)\n"
        "target = gpu_check.build_target(gpu_check.TINY, torch.float32, torch.device('cpu'))\n"
        "draft = gpu_check.build_draft(target, gpu_check.TINY_CHECK)\n"
        # (not scipy: transformers itself may load it)
        "extra = {'matplotlib', 'datasets', 'gguf', 'pytest', 'hypothesis', 'plots', 'flash_attn'}\n"
        "print(env['schema'], sorted({m.split('.')[0] for m in sys.modules} & extra))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ddtree-gpu-profile/1 []"


def test_the_tiny_check_writes_its_profile_after_every_step_and_checks_fp32_too(tmp_path, monkeypatch):
    """A run cut short keeps what it measured: the profile is on disk after each step, not only at the end."""
    import dataclasses
    import json

    from experiments.studies import gpu_check
    out = tmp_path / "profile.json"
    seen = []
    real = gpu_check.verify_curve

    def spy(*args, **kwargs):  # when the verify curve starts, the oracle and losslessness are already on disk
        seen.append(json.loads(out.read_text())["models"]["tiny"])
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu_check, "verify_curve", spy)
    small = dataclasses.replace(gpu_check.TINY_CHECK, nodes=(1, 4), repeats=1, warmups=0, contexts=(32,),
                                lossless_budgets=("chain", 8), tree_budgets=(8,))
    monkeypatch.setattr(gpu_check, "TINY_CHECK", small)
    assert gpu_check.main(["--tiny", "--device", "cpu", "--out", str(out)]) == 0
    assert "oracle" in seen[0] and seen[0]["lossless"]["exact_match"] == seen[0]["lossless"]["runs_total"]
    final = json.loads(out.read_text())["models"]["tiny"]
    assert final["lossless_fp32"]["dtype"] == "float32" and final["lossless"]["oracle_mean_tau"] > 2.0
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 2  # real shapes on a CPU: refused
