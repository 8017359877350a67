"""An existing folder given where a file is expected is named as a folder, never as "no such file" (issue #34)."""
from __future__ import annotations

import pytest

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import missing_file


def test_every_file_setting_names_a_folder_as_a_folder(tmp_path):
    from dit_pipeline.common.latent_stats import read_stats_file
    from dit_pipeline.evaluate.dinov2 import _weights_file
    from dit_pipeline.evaluate.inception import load_inception
    from dit_pipeline.train.checkpoint import load_checkpoint
    from dit_pipeline.train.config_file import load_config_file

    folder = tmp_path / "weights"
    folder.mkdir()
    said = f"{folder} is a folder, not a file; pass a file in it"
    assert missing_file(folder) == said
    assert missing_file(tmp_path / "none.pt") == f"no such file ({tmp_path / 'none.pt'})"
    calls = {"--config": lambda: load_config_file(folder), "--latent-stats": lambda: read_stats_file(folder, 4),
             "--dinov2": lambda: _weights_file(str(folder)), "--inception": lambda: load_inception(folder),
             "checkpoint": lambda: load_checkpoint(folder)}
    for flag, call in calls.items():
        with pytest.raises(UserError) as e:
            call()
        assert f"{flag} {folder}: {said}" in str(e.value), str(e.value)
        assert "no such file" not in str(e.value) and "does not exist" not in str(e.value)
