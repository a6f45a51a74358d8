"""Scripts for running blackbox on a lent GPU machine (see README "On a GPU")."""
