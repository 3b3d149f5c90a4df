"""The peer for bench_serving.py: the same pass served as an MLflow pyfunc model.

What a user might do without ElasticCTR: wrap the dense inference model and
the pass's sparse table (looked up in-process, no cube) in a PythonModel and
run ``mlflow models serve --env-manager local``. Input: a DataFrame with a
``line`` column of slot-format lines; output: click probabilities.
"""

from __future__ import annotations

import mlflow.pyfunc


class CtrPassModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        import pyarrow  # noqa: F401  (before paddle)

        from ctr_foundation.pass_format import load_pass
        from elastic_control.inference.scoring import DenseModel, InMemoryTable, prefer_fast_mkl

        prefer_fast_mkl()  # the same MKL kernels serving uses: the peer's dense model is as fast as ours

        self.info = load_pass(context.artifacts["pass"])
        self.table = InMemoryTable.from_pass(self.info)
        self.dense = DenseModel.from_pass(self.info)

    def predict(self, context, model_input, params=None):
        from elastic_control.inference.scoring import score_lines

        return score_lines(list(model_input["line"]), self.info, self.table.lookup, self.dense)


def save(pass_dir: str, out_dir: str) -> str:
    """Save the pyfunc model for ``pass_dir`` under ``out_dir``; returns the model path."""
    mlflow.pyfunc.save_model(out_dir, python_model=CtrPassModel(), artifacts={"pass": pass_dir}, code_paths=[__file__])
    return out_dir
