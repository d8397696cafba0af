"""Example models shipped with autopar (``autopar.examples``)."""
