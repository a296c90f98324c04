"""`phalanx train --local SPEC [--out DIR]`: the single-process reference trainer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer


def _read_spec(path: Path) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror}") from None
    try:
        spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"{path} is not valid JSON/YAML: {exc}") from None
    if not isinstance(spec, dict):
        raise typer.BadParameter(f"{path} must hold a job spec object")
    return spec


def _table(rows: list[Any]) -> Any:
    from rich.table import Table

    table = Table(title="epochs")
    for col in ("epoch", "step", "train loss", "train acc", "val loss", "val acc", "lr",
                "samples/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.epoch), str(r.step), f"{r.train_loss:.4f}",
                      f"{r.train_accuracy:.4f}", _opt(r.val_loss), _opt(r.val_accuracy),
                      f"{r.lr:.5f}", f"{r.samples_per_s:,.0f}")
    return table


def _opt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def register(app: typer.Typer) -> None:
    """Mount `train` on the root app."""

    @app.command()
    def train(
        spec: Path = typer.Argument(..., help="job spec, JSON or YAML"),
        local: bool = typer.Option(False, "--local", help="train in this process (reference)"),
        out: Path | None = typer.Option(None, "--out", help="write checkpoint.npz, metrics.json"),
        backend: str = typer.Option("numpy", help="numpy or torch"),
        data_dir: Path | None = typer.Option(None, envvar="PHALANX_DATA_DIR",
                                             help="where uploaded datasets live"),
        quiet: bool = typer.Option(False, "--quiet", help="no progress bar or table"),
    ) -> None:
        """Train a job spec. The last output line is the final metrics as JSON."""
        from rich.console import Console

        from engine.data import DatasetError
        from phalanx.train_local import run_reference

        if not local:
            raise typer.BadParameter("only --local is supported here; submit cluster jobs "
                                     "with `phalanx jobs submit`", param_hint="--local")
        rows: list[Any] = []
        try:
            metrics = run_reference(_read_spec(spec), out, progress=not quiet,
                                    data_dir=data_dir, backend=backend, on_epoch=rows.append)
        except (DatasetError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        if not quiet:
            Console().print(_table(rows))
        typer.echo(json.dumps(metrics))
