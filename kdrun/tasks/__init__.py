"""Tasks: task kinds (classification/regression, extractive QA, raw-text corpora) behind one
registry, their data (GLUE TSV / datasets / SQuAD JSON / toy), metrics and majority baselines."""
