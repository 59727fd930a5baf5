"""The artifact layout written under the target's directory (`DIR/neuron_trn3/`):

    manifest.json
    programs/<key>/model/graph.hlo           serialized HloModuleProto (tuple root): compile input
    programs/<key>/model/graph.hlo.txt       HLO text with metadata, for review and diff
    programs/<key>/model/graph.stablehlo.mlir
    programs/<key>/command.txt               exact neuronx-cc argv (run from programs/<key>/)
    programs/<key>/io_spec.json              ordered inputs/outputs: name, role, shape, dtype, alias
    scripts/compile.sh                       compiles every program (in parallel, cached)

After a real compile, graph.neff and log-neuron-cc.txt appear beside command.txt. Every file is
written to a temporary name and renamed, so a reader never sees half a file.

What follows NxD ModelBuilder's layout (`<workdir>/<tag>/_tp0_bk<N>/model/graph.hlo`, with the NEFF
and the compiler log beside `model/`): model/graph.hlo, graph.neff and the log, only. The
`programs/<key>/` directory (in place of `<tag>/_tp0_bk<N>/`), command.txt, io_spec.json, the
text and StableHLO copies, manifest.json and scripts/compile.sh are portable's own
(manifest.LAYOUT says the same in every manifest).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .artifact import NeuronLowered
from .command import HLO_FILE
from .script import compile_script

__all__ = ["MANIFEST", "write_layout"]

MANIFEST = "manifest.json"


def write_layout(out_dir: Path, lowered: NeuronLowered, manifest: dict[str, Any]) -> list[Path]:
    """Write every artifact of `lowered` under `out_dir`; return the paths written (sorted)."""
    from portable import __version__

    files = []
    for prog in lowered.programs:
        base = out_dir / "programs" / prog.key
        hlo = base / HLO_FILE
        files += [
            _write(hlo, prog.hlo),
            _write(hlo.with_name("graph.hlo.txt"), prog.hlo_text.encode()),
            _write(hlo.with_name("graph.stablehlo.mlir"), prog.stablehlo.encode()),
            _write(base / "command.txt", prog.command_txt.encode()),
            _write(base / "io_spec.json", _json(prog.io_spec)),
        ]
    script = compile_script([p.key for p in lowered.programs], version=__version__)
    files.append(_write(out_dir / "scripts" / "compile.sh", script.encode(), mode=0o755))
    files.append(_write(out_dir / MANIFEST, _json(manifest)))
    return sorted(files)


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, path)
    return path
