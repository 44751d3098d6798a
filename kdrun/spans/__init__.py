"""Word and phrase spans for MGSKD: a CoNLL-2000-trained NLTK chunker aligned to WordPieces."""
