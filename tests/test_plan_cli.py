"""`dion3 plan` end to end on the fake process group: JSON output of a small preset, and a world
of 1024 ranks (FSDP2 + TP) planned on this CPU."""
from __future__ import annotations

import json

from dion3.tools.plan import cli


def test_json_accounts_for_every_matrix_and_byte(tmp_path):
    out = tmp_path / "plan.json"
    assert cli.main(["--preset", "llama-1b", "--layout", "fsdp=4", "--optimizers", "muon,dion3",
                     "--json", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["world_size"] == 4
    for entry in data["optimizers"]:
        ranks = entry["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
        assert sum(r["owned"] for r in ranks) == 16 * 7  # every matrix of 16 layers has one owner
        # fp32 parameters split over 4 ranks: 0.97 B matrix parameters in all
        total = sum(r["memory_gb"]["params"] for r in ranks) * 1e9
        assert abs(total - 4 * (16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 8192 * 2048))) < 1e3
        # an all-to-all: what all ranks send, all ranks receive
        sent = sum(sum(r["sent_mb"].values()) for r in ranks)
        assert abs(sent - sum(sum(r["received_mb"].values()) for r in ranks)) < 1e-6


def test_a_world_of_1024_ranks_plans(capsys):
    assert cli.main(["--shapes", "4096x4096:8,1024x4096:8", "--layout", "fsdp=128,tp=8", "--optimizers", "dion3",
                     "--json", "-", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    ranks = data["optimizers"][0]["ranks"]
    assert len(ranks) == 1024 and sum(r["owned"] for r in ranks) == 16
