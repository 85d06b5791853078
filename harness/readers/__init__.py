"""Reading run directories: frames, summaries, reports, figures, advice. Never measures; imports neither torch nor the variants."""
