"""Models: loading pre-trained and random models of every family, the adaptors that turn any
model's outputs into one features record, and the student-to-teacher layer mapping."""
