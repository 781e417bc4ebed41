"""Files in and out: shard reading (``checkpoint``) and writing (``shards``), output folders
(``outdir``), the model's structure, where a source comes from (``source``), its tokenizer, text,
and the bundled model."""
