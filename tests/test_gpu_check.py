"""The GPU check (experiments/gpu_check.py) runs with only what a bare GPU image has: torch, transformers, numpy."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_needs_nothing_beyond_torch_transformers_numpy(tmp_path):
    """What a bare GPU image has is enough: the check pulls in none of the project's other dependencies."""
    code = (
        "import sys, torch\n"
        "from experiments import gpu_check\n"
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
