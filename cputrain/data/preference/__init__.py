"""Preference pairs: a prompt with a chosen and a rejected answer (DPO, SimPO)."""
