"""Corpus quality: the compact fp32 golden over a corpus and the judged teacher-forced pass."""
