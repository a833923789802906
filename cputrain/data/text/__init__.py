"""Text: documents joined with EOS and cut into rows of data.seq_len (pretraining)."""
