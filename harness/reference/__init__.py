"""The truth: transformers' reference runs (whole, streamed, teacher-forced) and the goldens that store them."""
