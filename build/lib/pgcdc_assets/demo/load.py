"""The demo's load: a thread making small random shop transactions while the incremental runs drain."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from decimal import Decimal

import psycopg
from psycopg.types.json import Jsonb

from pgcdc_assets.demo.console import DemoFailure


class LoadGenerator(threading.Thread):
    """Inserts, updates and deletes in small transactions until stopped; can pause between transactions.

    Transactions run while holding ``_lock`` and only while ``_running`` is set, so
    :meth:`pause` returns with no transaction in flight and none starting until :meth:`resume`.
    """

    def __init__(self, dsn: str, seed: int = 7) -> None:
        super().__init__(name="pgcdc-demo-load", daemon=True)
        self._dsn = dsn
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._stopped = threading.Event()
        self.transactions = 0
        self.counts: Counter[str] = Counter()
        self.error: BaseException | None = None

    # control
    def pause(self) -> None:
        self._running.clear()
        with self._lock:
            pass

    def resume(self) -> None:
        if self.error is None:
            self._running.set()

    def stop(self) -> None:
        self.pause()
        self._stopped.set()
        self.join(timeout=30)
        if self.error is not None:
            raise DemoFailure(f"load generator failed: {self.error!r}")

    # work
    def run(self) -> None:
        try:
            with psycopg.connect(self._dsn, application_name="pgcdc-demo-load") as conn:
                self._load_ids(conn)
                actions = self._actions()
                names = list(actions)
                weights = [actions[name][0] for name in names]
                while not self._stopped.is_set():
                    with self._lock:
                        if self._running.is_set():
                            name = self._random.choices(names, weights)[0]
                            with conn.transaction():
                                actions[name][1](conn)
                            self.transactions += 1
                            self.counts[name] += 1
                            ran = True
                        else:
                            ran = False
                    if ran:
                        time.sleep(self._random.uniform(0.002, 0.01))
                    else:
                        self._running.wait(0.05)
        except BaseException as error:  # reported by stop()
            self.error = error
            self._running.clear()

    def _load_ids(self, conn: psycopg.Connection) -> None:
        self.customers = [row[0] for row in conn.execute("SELECT id FROM shop.customers ORDER BY id")]
        self.products = [row[0] for row in conn.execute("SELECT id FROM shop.products ORDER BY id")]
        self.orders = [row[0] for row in conn.execute("SELECT id FROM shop.orders ORDER BY id")]
        self.items = {(o, p) for o, p in conn.execute("SELECT order_id, product_id FROM shop.order_items")}
        conn.commit()

    def _actions(self) -> dict[str, tuple[int, Callable[[psycopg.Connection], None]]]:
        """Each kind of shop transaction with its weight."""
        return {
            "new_order": (20, self._new_order),
            "advance_order": (20, self._advance_order),
            "change_qty": (8, self._change_qty),
            "remove_item": (5, self._remove_item),
            "delete_order": (4, self._delete_order),
            "reprice": (10, self._reprice),
            "retag": (5, self._retag),
            "new_customer": (6, self._new_customer),
            "new_email": (6, self._new_email),
            "forget_customer": (2, self._forget_customer),
            "page_views": (15, self._page_views),
        }

    def _new_order(self, conn: psycopg.Connection) -> None:
        r = self._random
        products = r.sample(self.products, r.randint(1, 3))
        ((order_id,),) = conn.execute(
            "INSERT INTO shop.orders (customer_id, total, note) VALUES (%s, %s, %s) RETURNING id",
            (r.choice(self.customers), Decimal(r.randint(500, 90000)) / 100, r.choice([None, None, "asap"])),
        ).fetchall()
        for product in products:
            conn.execute(
                "INSERT INTO shop.order_items (order_id, product_id, qty) VALUES (%s, %s, %s)",
                (order_id, product, r.randint(1, 5)),
            )
            self.items.add((order_id, product))
        self.orders.append(order_id)

    def _advance_order(self, conn: psycopg.Connection) -> None:
        r = self._random
        conn.execute(
            "UPDATE shop.orders SET status = %s::shop.order_status, note = %s WHERE id = %s",
            (r.choice(["paid", "shipped", "delivered", "cancelled"]), r.choice([None, "updated", "ça va ✓"]),
             r.choice(self.orders)),
        )  # fmt: skip

    def _change_qty(self, conn: psycopg.Connection) -> None:
        r = self._random
        if self.items:
            order_id, product = r.choice(tuple(self.items))
            conn.execute(
                "UPDATE shop.order_items SET qty = qty + 1 WHERE order_id = %s AND product_id = %s",
                (order_id, product),
            )

    def _remove_item(self, conn: psycopg.Connection) -> None:
        r = self._random
        if self.items:
            item = r.choice(tuple(self.items))
            conn.execute("DELETE FROM shop.order_items WHERE order_id = %s AND product_id = %s", item)
            self.items.discard(item)

    def _delete_order(self, conn: psycopg.Connection) -> None:
        r = self._random
        if len(self.orders) > 10:
            order_id = self.orders.pop(r.randrange(len(self.orders)))
            conn.execute("DELETE FROM shop.orders WHERE id = %s", (order_id,))  # items cascade
            self.items = {item for item in self.items if item[0] != order_id}

    def _reprice(self, conn: psycopg.Connection) -> None:
        # Leaves attributes alone: for the large (TOASTed) ones pgoutput sends "unchanged".
        r = self._random
        conn.execute(
            "UPDATE shop.products SET price = round(price * %s, 2) WHERE id = %s",
            (Decimal(r.choice(["0.9", "1.05", "1.1"])), r.choice(self.products)),
        )

    def _retag(self, conn: psycopg.Connection) -> None:
        r = self._random
        conn.execute(
            "UPDATE shop.products SET tags = %s, attributes = attributes || %s WHERE id = %s",
            (r.choice([["sale"], ["new", "limited"], [], None, ['quote"d', "com,ma"]]),
             Jsonb({"rating": r.randint(1, 5)}), r.choice(self.products)),
        )  # fmt: skip

    def _new_customer(self, conn: psycopg.Connection) -> None:
        r = self._random
        ((customer_id,),) = conn.execute(
            "INSERT INTO shop.customers (name, email) VALUES (%s, %s) RETURNING id",
            (r.choice(["Grace", "Linus", "Barbara", "Edsger", "Zoë"]) + f" {r.randint(1, 10**6)}", None),
        ).fetchall()
        conn.execute(
            "UPDATE shop.customers SET email = %s WHERE id = %s", (f"Customer{customer_id}@Shop.test", customer_id)
        )
        self.customers.append(customer_id)

    def _new_email(self, conn: psycopg.Connection) -> None:
        r = self._random
        customer_id = r.choice(self.customers)
        conn.execute(
            "UPDATE shop.customers SET email = %s WHERE id = %s",
            (f"c{customer_id}.{r.randint(1, 10**6)}@example.org", customer_id),
        )

    def _forget_customer(self, conn: psycopg.Connection) -> None:
        r = self._random
        if len(self.customers) > 10:
            customer_id = self.customers.pop(r.randrange(len(self.customers)))
            conn.execute("DELETE FROM shop.customers WHERE id = %s", (customer_id,))  # orders: SET NULL

    def _page_views(self, conn: psycopg.Connection) -> None:
        r = self._random
        with conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO shop.page_views (at, path, customer_id) VALUES (now(), %s, %s)",
                [(f"/products/{r.choice(self.products)}", r.choice([None, r.choice(self.customers)]))
                 for _ in range(r.randint(1, 5))],
            )  # fmt: skip
