"""Models in and out: `phalanx jobs export`, `phalanx models export` and `phalanx models import`.

`jobs export JOB` fetches the job's spec, its dataset's shape and its latest checkpoint from the
server and writes the trained model as ONNX, safetensors or a torch state_dict
(phalanx.modelio.export). `models export` does the same offline, from a spec file and a
checkpoint .npz (`phalanx train --local --out`, `phalanx jobs checkpoint`). `models import`
turns an ONNX graph into `model.layers` YAML on stdout. A refusal is one line on stderr and
exit status 1, as every command's.
"""

from __future__ import annotations

import enum
import io
import re
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import numpy as np
import typer
import yaml

from phalanx.cli import user_cmds
from phalanx.cli.user_cmds import (
    IdArg,
    ServerOpt,
    TokenOpt,
    connect,
    jobs_app,
    out,
    read_spec,
)
from phalanx.modelio import MissingExtra

if TYPE_CHECKING:  # the export code (engine, numpy models) loads when a command runs
    from phalanx.modelio.trained import DatasetFacts

models_app = typer.Typer(help="Export trained models; import ONNX graphs as model.layers.",
                         no_args_is_help=True)


class Format(str, enum.Enum):
    onnx = "onnx"
    safetensors = "safetensors"
    torch = "torch"


FormatOpt = Annotated[Format, typer.Option(
    "--format", help="onnx (the inference graph, for ONNX Runtime), safetensors or torch "
                     "(a state_dict under torchvision's names)")]
OutOpt = Annotated[Optional[Path], typer.Option(
    "--output-file", "-O", help="where to write it (default: JOB.onnx, .safetensors, .pt)")]
ShapeOpt = Annotated[Optional[str], typer.Option(
    "--input-shape", help="the model's input C,H,W (3,32,32 or 3x32x32): else the dataset's")]
# export does not train: any training-set size the spec accepts builds the same model
ANY_SIZE = 1 << 30


def fail(message: str) -> None:
    """One line and exit 1; the message escaped, or rich would take `[export]` for markup."""
    from rich.markup import escape

    user_cmds.fail(escape(message))


def jobs_export(job_id: IdArg, fmt: FormatOpt = Format.onnx, out_file: OutOpt = None,
                server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Write a job's trained model (its latest checkpoint) as ONNX, safetensors or torch."""
    with connect(server, token) as client:
        spec = client.job(job_id).get("spec") or {}
        dataset = client.dataset(str(spec.get("dataset", "")))
        data = client.checkpoint(job_id)
    shape, classes = dataset.get("input_shape"), dataset.get("num_classes")
    if not shape or not classes:
        fail(f"dataset {spec.get('dataset')!r} does not say its input shape and classes")
    facts = _facts(int(dataset.get("n_train") or ANY_SIZE), shape, int(classes))
    _write(spec, facts, _arrays(data, f"job {job_id}'s checkpoint"), fmt,
           out_file or Path(f"{job_id}{_suffix(fmt)}"), {"job": job_id})


@models_app.command("export")
def models_export(
    spec_file: Annotated[Path, typer.Option("--spec", help="the job spec, YAML or JSON")],
    params: Annotated[Path, typer.Option(
        "--params", help="the checkpoint .npz (phalanx jobs checkpoint, train --local --out)")],
    fmt: FormatOpt = Format.onnx, out_file: OutOpt = None, input_shape: ShapeOpt = None,
    classes: Annotated[Optional[int], typer.Option(
        help="the model's classes: else the dataset's")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(
        envvar="PHALANX_DATA_DIR", help="where uploaded datasets live")] = None,
) -> None:
    """Write a checkpoint as ONNX, safetensors or torch without a server."""
    spec = read_spec(spec_file)
    try:
        data = params.read_bytes()
    except OSError as exc:
        fail(f"cannot read {params}: {exc.strerror or exc}")
    if input_shape is None or classes is None:
        from engine.data import dataset_info
        from engine.dataset import DatasetError

        try:
            info = dataset_info(str(spec.get("dataset", "")), data_dir)
        except DatasetError as exc:
            fail(f"{exc}; or give --input-shape and --classes")
        facts = _facts(info.n_train, _shape(input_shape) if input_shape else info.input_shape,
                       classes or info.num_classes)
    else:
        facts = _facts(ANY_SIZE, _shape(input_shape), classes)
    _write(spec, facts, _arrays(data, str(params)), fmt,
           out_file or params.with_suffix(_suffix(fmt)), {"checkpoint": params.name})


@models_app.command("import")
def models_import(
    model_file: Annotated[Path, typer.Argument(help="the ONNX model (torch.onnx.export's)")],
    weights: Annotated[Optional[Path], typer.Option(
        "--weights", help="also write its weights, under the layers' names, to this .npz")] = None,
    input_shape: ShapeOpt = None,
) -> None:
    """Print an ONNX graph as model.layers YAML; an operator it cannot express is refused."""
    from engine.models import CUSTOM, parameter_count
    from phalanx.modelio.onnx_import import ImportRefused, import_onnx, read_onnx

    try:
        imported = import_onnx(read_onnx(model_file, weights=weights is not None),
                               weights=weights is not None)
    except (ImportRefused, MissingExtra) as exc:
        fail(f"{model_file}: {exc}")
    shape = _shape(input_shape) if input_shape else imported.input_shape
    classes = imported.num_classes or _last_units(imported.layers)
    lines = [f"# model.layers imported from {model_file.name} by phalanx models import"]
    if shape is not None:
        try:
            count = parameter_count(CUSTOM, shape, classes, {"layers": imported.layers})
        except ValueError as exc:
            fail(f"{model_file}: the imported layers do not build on {_dims(shape)} inputs: "
                 f"{exc}")
        lines.append(f"# {count:,} parameters on {_dims(shape)} inputs with {classes} "
                     f"classes: train it on a dataset of that shape and class count")
    if weights is not None:
        _save_npz(weights, imported.arrays)
        lines.append(f"# weights: {weights}")
    body = yaml.safe_dump({"model": {"layers": imported.layers}}, sort_keys=False,
                          default_flow_style=None, width=100)
    typer.echo("\n".join(lines) + "\n" + body, nl=False)


def _write(spec: dict[str, Any], facts: DatasetFacts, arrays: dict[str, np.ndarray], fmt: Format,
           path: Path, meta: dict[str, str]) -> None:
    from phalanx.modelio.export import export_bytes
    from phalanx.modelio.trained import load_trained

    try:
        trained = load_trained(spec, facts, arrays)
        trained.metadata.update(meta)
        payload = export_bytes(trained, fmt.value)
    except (ValueError, MissingExtra) as exc:
        fail(str(exc))
    try:
        path.write_bytes(payload)
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")
    model = trained.job.model
    out.print(f"{path}: {fmt.value}, {len(payload):,} bytes ({trained.job.spec.arch}, "
              f"{model.n_params:,} parameters, step {trained.step})", highlight=False)


def _facts(n_train: int, shape: Any, classes: int) -> DatasetFacts:
    from phalanx.modelio.trained import DatasetFacts

    dims = tuple(int(d) for d in shape)
    if len(dims) != 3:
        fail(f"the input shape is C,H,W; got {_dims(dims)}")
    return DatasetFacts(n_train, dims, int(classes))  # type: ignore[arg-type]


def _shape(text: str) -> tuple[int, int, int]:
    parts = re.split(r"[x,]", text.strip())
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        fail(f"--input-shape wants C,H,W such as 3,32,32; got {text!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def _dims(shape: Any) -> str:
    return "x".join(str(d) for d in shape)


def _suffix(fmt: Format) -> str:
    from phalanx.modelio.export import SUFFIXES

    return SUFFIXES[fmt.value]


def _arrays(data: bytes, what: str) -> dict[str, np.ndarray]:
    """An .npz's arrays (allow_pickle=False: a checkpoint holds numbers, never objects)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile):
        fail(f"{what} is not an .npz of arrays ({len(data):,} bytes)")
    raise AssertionError  # fail() exits


def _save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    try:
        with path.open("wb") as f:
            np.savez(f, **arrays)
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")


def _last_units(layers: list[dict[str, Any]]) -> int:
    dense = [layer["units"] for layer in layers if layer.get("type") == "dense"]
    return int(dense[-1]) if dense else 0


def register(app: typer.Typer) -> None:
    """Mount `jobs export` on the jobs app (user_cmds registers it first) and `models`."""
    jobs_app.command("export")(jobs_export)
    app.add_typer(models_app, name="models")
