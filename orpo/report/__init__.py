"""Figures and tables from the pipeline's artifacts: training curves, IFEval, judge, manifests, benchmarks, paper tables."""
