"""Export a trained run for use outside recaccel.

- ``torchrec``: a state dict that ``torchrec.models.dlrm.DLRM`` (``DLRM_DCN`` for DCN-v2
  runs) loads strictly, with the same predictions, plus its constructor arguments as
  JSON (:mod:`recaccel.export.torchrec_format`).
- ``torch_export``: a ``torch.export`` program over plain tensors (dense [B, Dd], one
  field-major CSR of ids) returning probabilities or ratings, which runs with PyTorch
  alone (:mod:`recaccel.export.serving`); :func:`encode` turns raw rows (a DataFrame,
  a pyarrow Table, a dict of lists) into its inputs as training mapped them.

Meta runs export their global model (the meta-learned initialization); per-task
adaptation happens online, on each task's support rows. See docs/export.md.
"""

from recaccel.export.encode import encode
from recaccel.export.load import LoadedRun, load_run
from recaccel.export.run import FORMATS, export_run
from recaccel.export.serving import ServingModel, export_program
from recaccel.export.torchrec_format import build_torchrec_model, torchrec_spec, torchrec_state_dict

__all__ = [
    "FORMATS",
    "LoadedRun",
    "ServingModel",
    "build_torchrec_model",
    "encode",
    "export_program",
    "export_run",
    "load_run",
    "torchrec_spec",
    "torchrec_state_dict",
]
