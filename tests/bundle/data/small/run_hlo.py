"""Compile, run and compare one HLO module of a gemma-parity HLO bundle. Standalone: numpy, and jax/jaxlib
for the CPU run (XLA's CPU backend), or the Neuron SDK's compiler and runtime for the device run;
nothing of gemma-parity, transformers or a checkpoint.

    python run_hlo.py BUNDLE [cpu|neuron|auto] [--any-toolchain] [--workdir DIR]

bundle.json names every file with its sha256: module.hlo.txt (the module as text; module.hlo.pb the
same as a serialized HloModuleProto, what neuronx-cc reads), inputs/*.npy (one per entry parameter, in
order), expected/*.npy (the reference run of the module on XLA's CPU backend, one per output), the
tolerance of each output and why, the neuronx-cc command and the toolchain it was built with. On
`cpu` the module text is parsed and run by jaxlib's XLA; on `neuron` module.hlo.pb is compiled by
neuronx-cc (libneuronxla.neuron_xla_compile, the call torch-neuronx makes) and run by the Neuron
runtime (nrtpy). A bundle may name a `test_module` (a stand-in for a miscompile: the module text with a
fault planted); on cpu that module is the one run.

Exit 0: every output within its tolerance; 1: an output moved (each one named), or the compiler failed;
2: the bundle cannot be judged here (a file missing or altered, another toolchain, a runner missing).
"""

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

JAX_VERSION = "0.10.2"  # the CPU runner the bundle's expected outputs were checked with
HLO_DTYPES = {"pred": "bool", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64", "u8": "uint8",
              "u16": "uint16", "u32": "uint32", "u64": "uint64", "f16": "float16", "f32": "float32",
              "f64": "float64", "bf16": "bfloat16"}


class Refused(Exception):
    """The bundle cannot be judged here: exit 2 with this line."""


def sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_bundle(root):
    """The manifest, every file it names checked present and unaltered."""
    root = Path(root)
    manifest_path = root / "bundle.json"
    if not manifest_path.is_file():
        raise Refused(f"{root}: no bundle.json (not an HLO bundle)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise Refused(f"{manifest_path}: not JSON ({exc})") from None
    for rel, digest in sorted(manifest.get("files", {}).items()):
        path = root / rel
        if not path.is_file():
            raise Refused(f"{path}: missing (bundle.json lists it); the bundle is incomplete: copy it whole")
        if sha256(path) != digest:
            raise Refused(f"{path}: altered (its sha256 is not the one bundle.json records); take the bundle as "
                          "written")
    return manifest


def np_dtype(hlo_dtype):
    name = HLO_DTYPES.get(hlo_dtype)
    if name is None:
        raise Refused(f"HLO dtype {hlo_dtype!r} has no array type here")
    if name == "bfloat16":
        import ml_dtypes  # installed with jaxlib
        return ml_dtypes.bfloat16
    return np.dtype(name)


def load_inputs(root, manifest, bf16_bits=False):
    """The parameters' values in their HLO dtypes; with `bf16_bits`, bf16 as its uint16 bit pattern
    (exact: the stored f32 values are bf16 values), for a runtime that takes raw buffers."""
    arrays = []
    for p in manifest["params"]:
        a = np.load(Path(root) / p["file"])
        if p["dtype"] == "bf16" and bf16_bits:
            arrays.append((a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16))
        else:
            arrays.append(a.astype(np_dtype(p["dtype"])))
    return arrays


def load_expected(root, manifest):
    return [np.load(Path(root) / o["file"]) for o in manifest["outputs"]]


# ---- the CPU run: jaxlib's XLA --------------------------------------------------------------------------

def cpu_client(any_toolchain=False):
    try:
        import jax
        from jax._src import xla_bridge
    except ImportError:
        raise Refused(f"the cpu run needs jax and jaxlib {JAX_VERSION} (pip install 'jax[cpu]=={JAX_VERSION}')") \
            from None
    if jax.__version__ != JAX_VERSION and not any_toolchain:
        raise Refused(f"jax {jax.__version__} is installed; this bundle was checked with jax {JAX_VERSION} "
                      "(install it, or pass --any-toolchain)")
    jax.config.update("jax_enable_x64", True)  # s64 parameters stay s64
    return xla_bridge.get_backend("cpu")


def run_text(text, inputs, client=None):
    """The HLO module text parsed, compiled and run on XLA's CPU backend: its outputs as arrays."""
    import jax
    from jaxlib import _jax, xla_client

    client = client or cpu_client(any_toolchain=True)
    jax.config.update("jax_enable_x64", True)
    proto = xla_client.hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
    device = client.local_devices()[0]
    executable = client.compile_and_load(_jax.mlir.hlo_to_stablehlo(proto), xla_client.DeviceList((device,)),
                                         xla_client.CompileOptions())
    placed = [jax.device_put(np.asarray(a), device) for a in inputs]  # alive until the outputs are copied
    out = executable.execute(placed)
    values = [np.array(o, copy=True) for o in out]
    del placed
    return values


def text_of_proto(proto):
    """A serialized HloModuleProto printed as parsable text with every constant in full."""
    cpu_client(any_toolchain=True)
    from jaxlib import xla_client

    options = xla_client.hlo.HloPrintOptions.short_parsable()
    options.print_large_constants, options.print_percent, options.print_metadata = True, True, False
    return xla_client.XlaComputation(proto).get_hlo_module().to_string(options)


# ---- the device run: neuronx-cc and the Neuron runtime ---------------------------------------------------

def neuron_toolchain(manifest, any_toolchain=False):
    from importlib import metadata

    wanted = manifest["toolchain"]["neuron"]["neuronx-cc"]
    try:
        found = metadata.version("neuronx-cc")
    except metadata.PackageNotFoundError:
        raise Refused("the neuron run needs neuronx-cc (the Neuron SDK's pip repository)") from None
    if not found.startswith(wanted) and not any_toolchain:
        raise Refused(f"neuronx-cc {found} is installed; this bundle was built with neuronx-cc {wanted} "
                      "(install it, or pass --any-toolchain to compile with this one)")
    return found


def run_neuron(root, manifest, inputs, workdir, any_toolchain=False):
    """module.hlo.pb compiled by neuronx-cc with the bundle's flags, run by the Neuron runtime."""
    neuron_toolchain(manifest, any_toolchain)
    import libneuronxla

    build = manifest["compile"]
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"compiling: {build['command']} (in {work})")
    try:
        neff = libneuronxla.neuron_xla_compile(
            module_bytes=(Path(root) / manifest["module"]["proto"]).read_bytes(), compiler_flags=build["flags"],
            input_format="hlo", platform_target=build["target"], cache_key=None, retry_failed_compilation=False,
            lazy=False, use_cache=False, cache_dir=None, work_dir=work)
    except Exception as exc:  # the compiler's failure is what the bundle shows
        print(f"COMPILE FAILED: {type(exc).__name__}: {exc}")
        return None
    (work / "module.neff").write_bytes(neff)
    try:
        from nrtpy import NrtpyModel
    except ImportError:
        raise Refused(f"compiled {work / 'module.neff'}; running it needs nrtpy (the Neuron runtime's Python "
                      "API, SDK 2.32 and later), not installed here") from None
    model = NrtpyModel.load_from_neff(str(work / "module.neff"))
    names = list(model.input_tensors_info)  # the NEFF's inputs, in the module's parameter order
    out = model(dict(zip(names, inputs)))
    return [np.asarray(out[n]) for n in model.output_tensors_info]


# ---- the comparison --------------------------------------------------------------------------------------

def compare(outputs, expected, manifest):
    """Per output: relative L2 error against the reference run, within its tolerance or moved."""
    rows = []
    for out, exp, spec in zip(outputs, expected, manifest["outputs"]):
        a, e = np.asarray(out, dtype=np.float64), np.asarray(exp, dtype=np.float64)
        if a.shape != e.shape:
            rows.append((spec["name"], float("inf"), spec["tolerance"], f"shape {a.shape} vs {e.shape}"))
            continue
        finite = np.isfinite(a) == np.isfinite(e)
        same_inf = np.where(np.isfinite(e), True, (a == e) | (np.isnan(a) & np.isnan(e)))
        diff = np.where(np.isfinite(e), a - e, 0.0)
        base = np.linalg.norm(np.where(np.isfinite(e), e, 0.0))
        err = float(np.linalg.norm(diff) / max(base, 1e-30)) if finite.all() and same_inf.all() else float("inf")
        rows.append((spec["name"], err, spec["tolerance"], ""))
    return rows


def report(rows):
    moved = [r for r in rows if not r[1] <= r[2]]
    for name, err, tol, note in rows:
        flag = "MOVED" if not err <= tol else "ok"
        print(f"  {flag:5} {name}: relative L2 {err:.3g} (tolerance {tol:.3g}){' ' + note if note else ''}")
    return moved


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle")
    p.add_argument("platform", nargs="?", default="auto", choices=("auto", "cpu", "neuron"))
    p.add_argument("--any-toolchain", action="store_true", help="run with the toolchain installed here")
    p.add_argument("--workdir", help="where neuronx-cc works (default: a temp directory)")
    return p.parse_args(argv)


def main(argv):
    if argv[:1] == ["--print-text"]:  # used when a bundle is written: the module's full text
        try:
            sys.stdout.write(text_of_proto(Path(argv[1]).read_bytes()))
            return 0
        except Refused as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    args = parse(argv)
    try:
        manifest = load_bundle(args.bundle)
        platform = args.platform
        if platform == "auto":
            from importlib.util import find_spec
            platform = "neuron" if find_spec("libneuronxla") else "cpu"
        expected = load_expected(args.bundle, manifest)
        print(f"{manifest['failure']['what']}\nplatform: {platform}")
        if platform == "cpu":
            client = cpu_client(args.any_toolchain)
            inputs = load_inputs(args.bundle, manifest)
            module = manifest.get("test_module") or manifest["module"]["text"]
            outputs = run_text((Path(args.bundle) / module).read_text(), inputs, client)
        else:
            neuron_toolchain(manifest, args.any_toolchain)
            inputs = load_inputs(args.bundle, manifest, bf16_bits=True)
            outputs = run_neuron(args.bundle, manifest, inputs, args.workdir or tempfile.mkdtemp(prefix="bundle-"),
                                 args.any_toolchain)
            if outputs is None:
                print("FAIL: the module did not compile (expected: it compiles and its outputs match)")
                return 1
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    moved = report(compare(outputs, expected, manifest))
    if moved:
        print(f"FAIL: {len(moved)} of {len(expected)} outputs moved: {', '.join(r[0] for r in moved)}")
        return 1
    print(f"PASS: all {len(expected)} outputs within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
