"""What the analysis notebooks call: load runs from MLflow, build the paper's tables, draw its figures."""
