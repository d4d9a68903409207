import dagster as dg
import pyarrow as pa

from rstar_pipelines.storage import ParquetIOManager, query, read_table
from rstar_pipelines.storage.query import asset_views

NODE = pa.struct(
    [("node_id", pa.string()), ("q", pa.float64()), ("children", pa.list_(pa.string()))]
)
TREES = pa.schema(
    [
        ("id", pa.string()),
        ("batch", pa.string()),
        ("nodes", pa.list_(NODE)),
        ("scores", pa.map_(pa.string(), pa.float64())),
    ]
)

batches = dg.DynamicPartitionsDefinition(name="test_batches")


def _trees(batch: str) -> pa.Table:
    rows = [
        {
            "id": f"{batch}-1",
            "batch": batch,
            "nodes": [
                {"node_id": "0", "q": 0.5, "children": ["0.1"]},
                {"node_id": "0.1", "q": -1.0, "children": []},
            ],
            "scores": [("ppm", 0.25)],
        },
    ]
    return pa.Table.from_pylist(rows, schema=TREES)


@dg.asset(partitions_def=batches)
def trees(context) -> pa.Table:
    return _trees(context.partition_key)


@dg.asset(partitions_def=batches)
def empty_trees() -> pa.Table:
    return TREES.empty_table()


@dg.asset(ins={"trees": dg.AssetIn(metadata={"allow_missing_partitions": True})})
def all_trees(trees: dict) -> pa.Table:
    return pa.concat_tables([trees[k] for k in sorted(trees)])


def test_nested_columns_and_empty_tables_round_trip(isolated_dirs):
    resources = {"io_manager": ParquetIOManager()}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("test_batches", ["b1", "b2"])
        for key in ("b1", "b2"):
            assert dg.materialize(
                [trees, empty_trees], partition_key=key, instance=instance, resources=resources
            ).success
        result = dg.materialize(
            [trees, empty_trees, all_trees],
            selection=[all_trees],
            instance=instance,
            resources=resources,
        )
        assert result.success

    lake = isolated_dirs / "lake"
    stored = read_table(lake / "trees" / "b1.parquet")
    assert stored.schema.equals(TREES, check_metadata=False)
    assert stored.to_pylist() == _trees("b1").to_pylist()
    assert stored.schema.metadata[b"rstar.partition"] == b"b1"

    empty = read_table(lake / "empty_trees" / "b2.parquet")
    assert empty.num_rows == 0 and empty.schema.equals(TREES, check_metadata=False)

    combined = read_table(lake / "all_trees.parquet")
    assert combined.column("batch").to_pylist() == ["b1", "b2"]

    assert set(asset_views(lake)) == {"trees", "empty_trees", "all_trees"}
    q = query(
        "select id, nodes[2].q as q, list_count(nodes) as n, scores['ppm'] as ppm "
        "from trees order by id"
    )
    assert q.to_pylist() == [
        {"id": "b1-1", "q": -1.0, "n": 2, "ppm": 0.25},
        {"id": "b2-1", "q": -1.0, "n": 2, "ppm": 0.25},
    ]
    # Nested values keep their types: no JSON inside strings.
    assert query("select * from trees").schema.field("nodes").type == pa.list_(NODE)
    assert query("select count(*) as n from empty_trees").to_pylist() == [{"n": 0}]
    assert query("select typeof(nodes[1].q) as t from all_trees limit 1").to_pylist() == [
        {"t": "DOUBLE"}
    ]
