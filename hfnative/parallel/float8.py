FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
