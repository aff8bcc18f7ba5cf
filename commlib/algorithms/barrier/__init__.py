"""barrier's schedules: dissemination."""
