"""--task shop's environment (--env support.shop:Shop, the task's default): one shop per completion,
holding its row's price list (data.shop_rows), which the question does not show. The model looks up
each item of the basket with `price` and adds them up with `calculator`: two tools, three or more
calls, and the state (which prices it looked up) lives in the instance. Run in the worker process:
no torch here."""

from support.calculator import calculator as exact


class Shop:
    """A shop with a small price list of its own, drawn for the row."""

    reward_method = "looked_up"

    def reset(self, prices, basket):
        self.prices, self.basket, self.seen = dict(prices), dict(basket), set()

    def price(self, item: str) -> int:
        """The price of one unit of an item in this shop.

        Args:
            item: the item's name, as the question writes it
        """
        if item not in self.prices:
            raise ValueError(f"this shop sells no {item!r}")
        self.seen.add(item)
        return self.prices[item]

    def calculator(self, expression):
        """The value of an arithmetic expression: + - * / ** and parentheses, e.g. 2*4+3*7."""
        return exact(expression)

    def looked_up(self, completion):
        """The share of the basket's items whose price this completion looked up (0 to 1)."""
        return len(self.seen & set(self.basket)) / len(self.basket)
