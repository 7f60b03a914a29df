"""The machinery behind the concepts at the root: see lab/README.md."""
