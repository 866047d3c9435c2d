"""What the commands print and write: tables, Markdown, JSON, plots."""
