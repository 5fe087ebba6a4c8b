"""Pools: seeded, editable by admins, with worker heartbeats."""


def test_seeded_pools_and_the_live_cpu_worker(api):
    pools = {p["name"]: p for p in api.get("/api/v1/pools").json()["data"]}
    assert {"cpu", "tpu-v5p-8", "tpu-v6e-8"} <= set(pools)
    assert pools["tpu-v5p-8"]["accelerator"] == "tpu-v5p-8" and pools["tpu-v5p-8"]["chips"] == 4
    assert pools["tpu-v6e-8"]["chips"] == 8
    cpu = pools["cpu"]
    assert cpu["workers_online"] >= 1
    assert all(w["pool"] == "cpu" and w["online"] for w in cpu["workers"])
    assert pools["tpu-v5p-8"]["workers_online"] == 0


def test_admin_creates_updates_deletes_pool(api):
    pool = {"name": "gpu-h100x2", "accelerator": "gpu-h100x2", "chips": 2, "price_per_chip_hour": 6.98}
    r = api.post("/api/v1/pools", json=pool)
    assert r.status_code == 201, r.text
    assert api.post("/api/v1/pools", json=pool).status_code == 422  # name taken
    r = api.patch("/api/v1/pools/gpu-h100x2", json={"price_per_chip_hour": 5.5})
    assert r.status_code == 200 and r.json()["price_per_chip_hour"] == 5.5
    assert api.delete("/api/v1/pools/gpu-h100x2").status_code == 204
    assert api.get("/api/v1/pools/gpu-h100x2").status_code == 404


def test_bad_pool_names_the_field(api):
    r = api.post("/api/v1/pools", json={"name": "x", "accelerator": "abacus", "chips": 1, "price_per_chip_hour": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "accelerator"]
    r = api.post("/api/v1/pools", json={"name": "y", "accelerator": "cpu", "chips": 0, "price_per_chip_hour": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "chips"
    r = api.post("/api/v1/pools", json={"name": "Bad Name", "accelerator": "cpu", "chips": 1, "price_per_chip_hour": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"]
    names = {p["name"] for p in api.get("/api/v1/pools").json()["data"]}
    assert not {"x", "y", "Bad Name"} & names


def test_null_for_a_field_that_must_have_a_value_is_refused_and_changes_nothing(api):
    pool = {"name": "null-patch", "accelerator": "cpu", "chips": 2, "price_per_chip_hour": 1.5, "description": "x"}
    assert api.post("/api/v1/pools", json=pool).status_code == 201
    try:
        for field in ("accelerator", "chips", "price_per_chip_hour", "description"):
            r = api.patch("/api/v1/pools/null-patch", json={field: None})
            assert r.status_code == 422, (field, r.text)
            assert r.json()["detail"][0]["loc"] == ["body", field], r.json()
        after = api.get("/api/v1/pools/null-patch").json()
        assert {k: after[k] for k in pool} == pool
    finally:
        api.delete("/api/v1/pools/null-patch")


def test_a_price_that_is_not_a_finite_number_is_refused(api):
    for price in ("Infinity", "NaN", 1e12):
        body = {"name": "odd-price", "accelerator": "cpu", "chips": 1, "price_per_chip_hour": price}
        r = api.post("/api/v1/pools", json=body)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "price_per_chip_hour"], r.text
    assert api.get("/api/v1/pools/odd-price").status_code == 404


def test_slice_pools_are_seeded_and_their_chips_split_evenly_over_hosts(api):
    """Multi-host TPU slices are seeded, and a slice's chips split evenly over its hosts. (Workers on the
    hosts of a slice, and runs across them: test_slice_runs.py.)"""
    pools = {p["name"]: p for p in api.get("/api/v1/pools").json()["data"]}
    assert (pools["tpu-v5p-16"]["hosts_per_slice"], pools["tpu-v5p-16"]["chips_per_host"]) == (2, 4)
    assert (pools["tpu-v5p-32"]["hosts_per_slice"], pools["tpu-v5p-32"]["chips_per_host"]) == (4, 4)
    assert pools["cpu"]["hosts_per_slice"] == 1 and pools["cpu"]["slices"] == []

    bad = {"name": "odd-slice", "accelerator": "cpu", "chips": 3, "hosts_per_slice": 2, "price_per_chip_hour": 0}
    r = api.post("/api/v1/pools", json=bad)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "hosts_per_slice"], r.text
    assert "3 chips do not split evenly over 2 hosts" in r.json()["detail"][0]["msg"]
    pool = {"name": "even-slice", "accelerator": "cpu", "chips": 4, "hosts_per_slice": 2, "price_per_chip_hour": 0}
    r = api.post("/api/v1/pools", json=pool)
    assert r.status_code == 201 and r.json()["chips_per_host"] == 2 and r.json()["slices"] == [], r.text
    r = api.patch("/api/v1/pools/even-slice", json={"chips": 5})
    assert r.status_code == 422 and "5 chips do not split evenly over 2 hosts" in r.text
    assert api.delete("/api/v1/pools/even-slice").status_code == 204
